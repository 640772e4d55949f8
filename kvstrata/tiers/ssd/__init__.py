"""The SSD tier: a capacity-bounded, checksummed, crash-safe block store.
May import: errors, system, identity, config, policy.

Two files under the tier's directory:

* ``blocks.dat`` (:mod:`.pagefile`): the payloads, each in a run of whole
  4 KiB pages written with ``pwrite`` straight from the encoded block,
  allocated best-fit by :mod:`.extents`.
* ``data.mdb`` (:mod:`.index`): an LMDB environment holding, per record, a
  small head (header, first page, checksum, access clock, payload tail; the
  format is :mod:`.record`) and an LRU entry.

A record becomes visible when its head is committed, after its body was
written. Pages of a deleted or evicted record are reused only once the
deletion is synced and no read that could still hold the old head is running
(:mod:`.reclaim`). A clean close saves a snapshot (:mod:`.snapshot`): a digest
of the closed index and the free-space map; an open that finds ``data.mdb``
exactly as the snapshot describes takes it as is. Otherwise (an unclean
shutdown, damage) the tier recovers (:mod:`.recovery`): the environment is
walked in a child process (:mod:`.walk`), which surveys every head
(:mod:`.survey`) to rebuild the free-space map; a large index recovers in the
background while the tier serves misses. Fingerprints get separate namespaces
(a 16-byte key prefix); blocks of another fingerprint are never visible and
age out through the shared LRU.

Writes are asynchronous: ``put`` copies a block into a bounded queue
(:mod:`.writequeue`) and returns; one writer thread (:mod:`.writer`) encodes,
evicts and commits many blocks per transaction (their pages in one write,
their index entries in one call each), then syncs both files. Reads
(:mod:`.reader`) verify the header and an ``xxh3_64`` checksum; a record that
does not verify is deleted and reported as a miss. Failures of the
environment degrade the tier to misses and dropped puts, logged once; they
never raise to the caller. :class:`SSDTier` (:mod:`.tier`) is the front.

Threads: the writer thread alone writes (index transactions, page writes,
the free-space map); any number of threads read; each module says what it
owns and which lock guards what it shares.
"""

from typing import Any

from kvstrata.tiers.ssd.footprint import capacity_blocks, record_footprint

__all__ = ["SSDTier", "capacity_blocks", "record_footprint"]


def __getattr__(name: str) -> Any:  # SSDTier lazily: the footprint arithmetic needs no lmdb
    if name == "SSDTier":
        from kvstrata.tiers.ssd.tier import SSDTier

        return SSDTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
