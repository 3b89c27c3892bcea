"""How the CUDA ops launch: the process-wide programmatic dependent launch (PDL) switch.

With PDL on, every mlakv CUDA op launches its kernels with the programmatic-stream-serialization
attribute: on Hopper (sm_90+) a kernel may be scheduled while the previous kernel in the stream is
still finishing, and waits for it (``griddepcontrol.wait``) before reading any input, so a chain of
small kernels (a decode step captured in a CUDA graph) hides part of the launch latency between
them. Results are byte-identical with and without it.

The switch is read by each op when it launches, so it affects the CUDA ops launched, or captured
into a CUDA graph, while it is on; a captured graph keeps the setting it was captured with. It is
process-wide (every thread, every GPU). It is a host-side setting: ``set_pdl`` raises inside
``torch.compile(fullgraph=True)`` (without fullgraph it runs eagerly at a graph break); the compiled
ops read the switch when they run, like eager ones. The CPU backend ignores it.

GPUs before sm_90 (no PDL in hardware): the binding launches their kernels without the attribute
whatever the switch says (the core's ``launch_kernel`` would pass it as given, and the kernels'
``griddepcontrol`` instructions are compiled only for sm_90+). The default build holds Hopper code
only, so its CUDA ops run on sm_90+ GPUs anyway.

The default is off, or on when ``MLAKV_PDL=1`` is in the environment when the extension is
loaded (``import mlakv``): the C++ extension reads it once; after that only ``set_pdl`` changes it.
"""

import contextlib
from typing import Iterator

import torch

__all__ = ["pdl", "pdl_enabled", "set_pdl"]


def set_pdl(enabled: bool) -> None:
    """Turns programmatic dependent launch of the mlakv CUDA ops on or off, process-wide.

    Affects the CUDA ops launched, or captured into a CUDA graph, while it is on; harmless on GPUs
    before sm_90 (their kernels launch without the attribute); the CPU backend ignores it. Call
    it outside compiled code. See ``mlakv.launch`` for the details.
    """
    if torch.compiler.is_compiling():
        # Traced, the op would run once at trace time (it has no tensor to make fake) and then
        # depend on whether the graph keeps a call that returns nothing.
        raise RuntimeError("mlakv.set_pdl: a host-side setting; call it outside torch.compile'd "
                           "code")
    torch.ops.mlakv.set_pdl(bool(enabled))


def pdl_enabled() -> bool:
    """True when the programmatic dependent launch switch of the mlakv CUDA ops is on (``set_pdl``,
    ``pdl``, or ``MLAKV_PDL=1`` at import)."""
    return bool(torch.ops.mlakv.get_pdl())


@contextlib.contextmanager
def pdl(enabled: bool = True) -> Iterator[None]:
    """``with mlakv.pdl():`` runs the block with programmatic dependent launch on (or off, with
    ``enabled=False``) and restores the previous setting on exit, also on an exception.

    Affects the CUDA ops launched, or captured into a CUDA graph (``torch.cuda.graph``), inside
    the block; harmless on GPUs before sm_90 (their kernels launch without the attribute); the CPU
    backend ignores it. The switch is process-wide: another thread's ops see it too while the
    block runs.
    """
    previous = pdl_enabled()
    set_pdl(enabled)
    try:
        yield
    finally:
        set_pdl(previous)
