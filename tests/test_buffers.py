"""Byte views of caller buffers (numpy arrays, CPU tensors, bytes-likes)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.buffers import as_numpy, nbytes, writable_view


def test_as_numpy_shares_memory_and_flattens_tensors():
    import torch
    arr = np.arange(6, dtype=np.float32)
    assert as_numpy(arr, "x") is arr
    buf = bytearray(b"abc")
    view = as_numpy(buf, "x")
    view[0] = ord("z")
    assert buf == bytearray(b"zbc") and view.dtype == np.uint8
    ten = torch.arange(4, dtype=torch.float16)
    out = as_numpy(ten, "x")
    assert out.dtype == np.uint8 and out.nbytes == 8
    out[:] = 0
    assert not ten.any()                      # the same memory


def test_as_numpy_refuses_what_it_cannot_view():
    import torch
    with pytest.raises(ValueError, match="^data: .*list"):
        as_numpy([1, 2], "data")
    with pytest.raises(ValueError, match="^data: must be contiguous"):
        as_numpy(torch.zeros(4, 4)[:, 0], "data")


def test_nbytes_without_converting():
    import torch
    assert nbytes(b"abc") == 3 and nbytes(bytearray(5)) == 5
    assert nbytes(memoryview(np.zeros(4, np.uint16))) == 8
    assert nbytes(np.zeros((2, 3), np.float32)) == 24
    assert nbytes(torch.zeros(3, dtype=torch.float16)) == 6
    with pytest.raises(ValueError, match="^data"):
        nbytes("text")


def test_writable_view_needs_writable_contiguous_memory():
    arr = np.zeros((2, 4), np.uint16)
    view = writable_view(arr, "outs")
    view[0] = 7
    assert view.nbytes == 16 and arr[0, 0] == 7
    with pytest.raises(ValueError, match="^outs: bytes are read-only"):
        writable_view(b"1234", "outs")
    with pytest.raises(ValueError, match="^outs"):
        writable_view(arr[:, ::2], "outs")
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="^outs"):
        writable_view(frozen, "outs")
