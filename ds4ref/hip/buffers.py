"""What a kernel launch hands the device, below the runtimes and the launch checks: device
allocations (a pointer parameter takes a DeviceBuffer or None) and the kernel sources as
compiled (local headers inlined)."""
from __future__ import annotations

import pathlib
import re

KERNEL_DIR = pathlib.Path(__file__).with_name("kernels")


class DeviceBuffer:
    """A device allocation; free() or the runtime's free() releases it."""

    def __init__(self, rt, ptr: int, nbytes: int, owned: bool = True):
        self.rt, self.ptr, self.nbytes = rt, int(ptr), int(nbytes)
        self.owned = owned  # False: a view into another buffer, which frees the memory

    def free(self) -> None:
        if self.ptr and self.owned:
            self.rt.free(self)

    def __repr__(self) -> str:
        return f"DeviceBuffer(0x{self.ptr:x}, {self.nbytes} B)"


def load_source(filename: str) -> str:
    """Kernel source with the portability header inlined (NVRTC has no include path)."""
    path = KERNEL_DIR / filename
    if not path.exists():
        raise FileNotFoundError(f"kernel source {path} does not exist")
    seen: set[str] = set()

    def inline(text: str) -> str:
        # each local header (kernels/*.h) is pasted once, at its first #include;
        # later includes of it (from other headers) become empty
        def paste(m: "re.Match[str]") -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return inline((KERNEL_DIR / name).read_text())
        return re.sub(r'^#include "([A-Za-z0-9_]+\.h)"[ \t]*$', paste, text, flags=re.M)

    return inline(path.read_text())


def view(buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer:
    """A non-owning DeviceBuffer at buf + offset (its free() does nothing): free `buf`."""
    if offset + nbytes > buf.nbytes:
        raise ValueError(f"view of {nbytes} B at {offset} exceeds {buf}")
    return DeviceBuffer(buf.rt, buf.ptr + offset, nbytes, owned=False)
