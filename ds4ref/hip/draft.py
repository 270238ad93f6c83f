"""What the device's draft modules (hip/mtp.py's MTP block, hip/dspark.py's DSpark draft) share:
their own per-slot state (a DeviceState of the module's config), pass buffers and int8 scratch,
and their recorded programs, released together."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from . import launch as K
from .device_state import DeviceState, lane_fields

I32 = np.int32


class DraftDevice(ABC):
    """Subclasses set `rt`, `w` (their DeviceWeights) and fill `state`, `_bufs` (named device
    buffers, None allowed) and `_q8` in configure; `_programs()` names their program dicts."""

    state: DeviceState | None = None

    def _init_buffers(self) -> None:
        self.state = None
        self._bufs: dict[str, object] = {}
        self._q8: K.Q8Rows | None = None

    def _zeros(self, n: int):
        buf = self.rt.malloc(4 * max(n, 1))
        self.rt.memset32(buf, 0, max(n, 1))
        return buf

    def _write_rows(self, rows, src) -> None:
        """A pass's lane fields, and its per-lane source lanes into the `src` buffer."""
        st = self.state
        st.write_lanes(lane_fields(rows, (), st.n_lanes))
        lanes = np.full(st.n_lanes, -1, I32)
        lanes[: len(src)] = src
        self.rt.h2d(self._bufs["src"], lanes)

    @abstractmethod
    def _reset_programs(self) -> None:
        """Forget the recorded programs and their graphs (the state they ran on is gone)."""

    # ---- the slots' draft state ------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        self.state.reset_slot(slot)

    def save_state(self, slot: int) -> int:
        return self.state.save_state(slot)

    def restore_state(self, slot: int, snapshot: int) -> None:
        self.state.restore_state(slot, snapshot)

    def drop_state(self, snapshot: int) -> None:
        self.state.drop_state(snapshot)

    # ---- releasing ---------------------------------------------------------------------
    def free_state(self) -> None:
        if self.state is not None:
            self.state.free()
            self.state = None
        for buf in self._bufs.values():
            if buf is not None:
                buf.free()
        self._bufs = {}
        if self._q8 is not None:
            self._q8.free()
            self._q8 = None
        self._reset_programs()

    def close(self) -> None:
        self.free_state()
        self.w.free()
