"""Moving one block between a shard's tiers: the bytes half of a two-phase tier change, run outside the store lock.

Who calls what: the block store (``kvpool.store``) only. Under its lock it starts a ``Move`` (allocates the
destination slot, marks the entry in transit: ``_Entry.move``), releases the lock, calls ``copy_out`` (a demotion:
DRAM slot → SSD slot), ``copy_in`` (a promotion: SSD slot → DRAM slot, then the block's checksum over the DRAM
copy) or ``read_copy`` (``read_block`` of an SSD block: SSD slot → private bytes, verified), re-takes the lock and
finishes the move there (switches the entry's tier, or gives the destination slot back).

Contract: while a move is in flight every slot it names belongs to it alone, on no free list, so nothing else
writes any of them (the source slot may be read meanwhile: a lease of a demoting block reads its DRAM slot). These
functions touch only the slots the move names: no store state, no lock, no clock. They never raise; the outcome
says what happened and the store decides (a promotion or read that is not ``"ok"`` is never data).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Literal

from kvpool.arena import DramArena
from kvpool.checksum import block_checksum
from kvpool.ssd import SsdSlab

log = logging.getLogger(__name__)

Outcome = Literal["ok", "corrupt", "io_error"]  # corrupt: short read or checksum mismatch (counted as such)


class MoveKind(enum.Enum):
    DEMOTE = "demote"  # DRAM → SSD: the entry stays visible (and leasable) in DRAM until the copy is done
    PROMOTE = "promote"  # SSD → DRAM for a lease: the entry stays in SSD, pinned by that lease, until verified
    READ = "read"  # SSD → bytes for read_block: the entry stays in SSD; its slot is neither freed nor reused


@dataclass(slots=True, eq=False)
class Move:
    """One block in transit. ``dram_slot`` is -1 while a promotion waits for a DRAM slot (and for a read).
    ``dropped``: the entry was removed from the index meanwhile; finishing frees every slot the move names."""

    kind: MoveKind
    dram_slot: int
    ssd_slot: int
    dropped: bool = False


def copy_out(arena: DramArena, ssd: SsdSlab, move: Move) -> Outcome:
    """Demotion's copy: the DRAM slot's bytes into the SSD slot."""
    try:
        ssd.write(move.ssd_slot, arena.view(move.dram_slot))
    except Exception as exc:  # noqa: BLE001 - any failure is an outcome the store handles, never an escape
        log.warning("demotion of DRAM slot %d to SSD slot %d failed: %s", move.dram_slot, move.ssd_slot, exc)
        return "io_error"
    return "ok"


def copy_in(arena: DramArena, ssd: SsdSlab, move: Move, checksum: int) -> Outcome:
    """Promotion's copy: the SSD slot's bytes into the DRAM slot, verified against ``checksum``."""
    try:
        out = arena.view(move.dram_slot)
        n = ssd.read_into(move.ssd_slot, out)
        good = n == len(out) and block_checksum(out) == checksum
    except Exception as exc:  # noqa: BLE001
        log.warning("promotion of SSD slot %d to DRAM slot %d failed: %s", move.ssd_slot, move.dram_slot, exc)
        return "io_error"
    return "ok" if good else "corrupt"


def read_copy(ssd: SsdSlab, move: Move, checksum: int) -> tuple[Outcome, bytes]:
    """``read_block``'s copy: the SSD slot's bytes, verified against ``checksum`` (b"" unless ``"ok"``)."""
    buf = bytearray(ssd.slot_bytes)
    try:
        n = ssd.read_into(move.ssd_slot, memoryview(buf))
    except Exception as exc:  # noqa: BLE001
        log.warning("read of SSD slot %d failed: %s", move.ssd_slot, exc)
        return "io_error", b""
    if n != len(buf) or block_checksum(buf) != checksum:
        return "corrupt", b""
    return "ok", bytes(buf)
