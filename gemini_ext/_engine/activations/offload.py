"""ActivationOffload: the inputs that checkpointed blocks keep between their forward and their
backward go to host memory as the forward runs and come back ahead of the backward
(`GeminiConfig(activation_offload="on")`, or per block where the plan says so).

[Note: what is offloaded, and how it is found]
- Under non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False) a block keeps
  only its inputs: the checkpoint saves them as autograd saved tensors at the call, before its
  region starts, and inside the region its own saved-tensor hooks replace every outer hook.
- The engine takes part in every checkpoint call it offloads (calls.py): its own block wrapping
  and the checkpoint function the model carries for its layers. Around such a call `taking(args)`
  enters the engine's saved-tensor hooks, so the only saves they see are that call's inputs, and
  they take a tensor only when it is one of the call's tensor arguments (the same storage, shape
  and dtype). Nothing else passes through them: autograd keeps everything else as it would, its
  own in-place checks included. calls.verify_mechanism() checks at enable() that this torch saves
  a checkpoint's inputs so.
- Taken: floating tensors on the compute device, contiguous, of at least `min_bytes`. The same
  tensor object, unchanged, saved by several checkpoints (a table every block gets as an input)
  goes once and is shared.
- Outer hooks win: where the caller's own saved-tensor hooks are active at the call (torch's
  `save_on_cpu` around the forward) the engine enters none, and HF's `offload=True` enters its own
  inside each checkpoint call, which shadow the engine's: nothing is offloaded twice.

[Note: the copies (cuda)]
- Forward: the device-to-host copy runs on a stream of its own after the work queued so far on
  the compute stream; the tensor is marked used by that stream, so its device memory is reused
  only once the copy is done.
- Backward: when the backward starts, the last `lookahead` offloaded inputs are fetched back on a
  host-to-device stream; each time a block's input is unpacked, the next ones (in backward order)
  are. An input not fetched ahead is copied on the compute stream when it is unpacked.
- The host buffers (host_buffers.py) go back to their pool when autograd frees the saved tensor,
  reused after the events of their copies on both streams, never after a host wait.
- In-place writes to a saved input after its block's forward, which autograd refuses for saved
  tensors but not under saved-tensor hooks, are refused at unpack (an input left on the device
  too): the engine holds the tensor until its copy is done (the
  device memory is held that long anyway) and compares its version then, which also covers a write
  racing the copy; a tensor that outlives its copy is compared again at unpack.
On sim the copies are synchronous CPU copies through the same code.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

MIN_OFFLOAD_BYTES = 1 << 20
LOOKAHEAD = 2


class _Kept:
    """A save the engine's hooks saw and left on the device. Saved-tensor hooks turn off autograd's
    own check that a saved tensor was not written in place; this is it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor, self.version = tensor, tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a tensor of shape {tuple(self.tensor.shape)} saved for backward is at version "
                f"{self.tensor._version}; expected version {self.version} instead (gemini_ext: the input of a "
                "checkpointed block). Write the modified value to a new tensor instead of in place.")
        return self.tensor


class _Offloaded:
    """One offloaded tensor: its host copy, and its device copy while one is fetched."""

    __slots__ = ("host", "shape", "dtype", "copied", "device_copy", "fetched", "version", "source", "index",
                 "written", "__weakref__")

    def __init__(self, host, shape, dtype, copied, version, source, index):
        self.host, self.shape, self.dtype, self.copied = host, shape, dtype, copied
        self.device_copy = self.fetched = None
        self.version, self.source, self.index = version, source, index
        self.written = None  # the version seen once the copy was done, where it had moved


class ActivationOffload:
    """The saved-tensor hooks over the model's forward; see the notes above."""

    def __init__(self, host_buffers, device: torch.device, min_bytes: int | None = None,
                 lookahead: int = LOOKAHEAD):
        self._buffers = host_buffers
        self._device = device
        self._cuda = device.type == "cuda"
        self._min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self._lookahead = lookahead
        self._d2h = torch.cuda.Stream(device) if self._cuda else None
        self._h2d = torch.cuda.Stream(device) if self._cuda else None
        self._order: list = []      # weak references to this forward's offloaded inputs, in forward order
        self._shared: dict = {}     # tensor identity -> weak reference to its _Offloaded
        self._in_flight: list = []  # (_Offloaded, its tensor) until the copy is done and the version checked
        self._depth = 0
        self._taking: list = []  # per checkpoint call being offloaded (nested calls stack): its inputs' keys
        self._streams = [self._d2h.cuda_stream, self._h2d.cuda_stream] if self._cuda else []
        self.counts = {"offloaded": 0, "offloaded_bytes": 0, "shared": 0, "kept": 0, "prefetched": 0,
                       "fetched_on_demand": 0, "forwards_under_outer_hooks": 0, "calls": 0}

    @contextlib.contextmanager
    def taking(self, args):
        """Around one checkpoint call: the engine's saved-tensor hooks are entered for the call, and
        its tensor arguments are the saves they take (none where the caller's hooks are active)."""
        self.counts["calls"] += 1
        if not torch.is_grad_enabled() or _outer_hooks_active():
            yield
            return
        self._taking.append({_key(a) for a in args if isinstance(a, torch.Tensor)})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._taking.pop()

    # --- the scope over the root module's forward (entered and left by the manager's hooks) ---------
    def remove(self) -> None:
        self._buffers.trim()

    def enter(self) -> None:
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled():
            return
        if _outer_hooks_active():
            self.counts["forwards_under_outer_hooks"] += 1
        if all(r() is None for r in self._order):  # every earlier forward's inputs are freed: start afresh
            self._order = []
        self._shared = {k: r for k, r in self._shared.items() if r() is not None}

    def leave(self) -> None:
        self._depth = max(0, self._depth - 1)  # also called where a pre-hook before ours raised
        if self._depth == 0:
            self._settle(wait=False)

    # --- forward: pack ---------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if not self._taking or _key(tensor) not in self._taking[-1] or not self._wanted(tensor):
            return _Kept(tensor)
        self._settle(wait=False)
        key = id(tensor)
        ref = self._shared.get(key)
        if ref is not None and (known := ref()) is not None and known.source is not None \
                and known.source() is tensor and known.version == tensor._version:
            self.counts["shared"] += 1
            return known
        nbytes = tensor.numel() * tensor.element_size()
        buf = self._buffers.acquire(nbytes, self._streams)  # see [Note: where the bytes come from]
        if buf is None:
            self.counts["kept"] += 1
            return _Kept(tensor)
        host = buf.view(tensor.dtype).view(tensor.shape)
        copied = self._copy_to_host(host, tensor)
        item = _Offloaded(host, tensor.shape, tensor.dtype, copied, tensor._version, _weak(tensor), len(self._order))
        self._shared[key] = weakref.ref(item)
        self._in_flight.append((item, tensor))
        self._order.append(weakref.ref(item))
        self.counts["offloaded"] += 1
        self.counts["offloaded_bytes"] += nbytes
        return item

    def _wanted(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self._device or not tensor.is_floating_point() or not tensor.is_contiguous():
            return False
        if tensor.layout != torch.strided or tensor.numel() * tensor.element_size() < self._min_bytes:
            return False
        return not (tensor.is_leaf and tensor.requires_grad)  # a parameter stays where its chunk is

    def _copy_to_host(self, host: torch.Tensor, tensor: torch.Tensor):  # see [Note: the copies (cuda)]
        if not self._cuda:
            host.copy_(tensor)
            return None
        self._d2h.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._d2h):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._d2h)
            done = torch.cuda.Event()
            done.record(self._d2h)
        return done

    # --- backward: unpack and fetch ahead --------------------------------------------------------
    def _settle(self, wait: bool) -> None:
        """Lets go of the tensors whose copy is done (all of them with `wait`), noting a version
        that moved since the pack."""
        keep = []
        for item, tensor in self._in_flight:
            if not wait and item.copied is not None and not item.copied.query():
                keep.append((item, tensor))
                continue
            if item.copied is not None:
                item.copied.synchronize()
            if tensor._version != item.version:
                item.written = tensor._version
        self._in_flight = keep

    def backward_started(self) -> None:
        """Fetches the last offloaded inputs, which the backward needs first."""
        self._settle(wait=True)
        for ref in reversed(self._order[-self._lookahead:]):
            if (item := ref()) is not None:
                self._fetch(item)

    def _unpack(self, packed):
        if isinstance(packed, _Kept):
            return packed.unpack()
        item = packed
        self._settle(wait=True)
        source = item.source() if item.source is not None else None
        written = item.written if item.written is not None else (
            source._version if source is not None and source._version != item.version else None)
        if written is not None:
            raise RuntimeError(
                "gemini_ext: one of the inputs of a checkpointed block, offloaded to the host "
                f"(activation_offload='on'), was modified by an inplace operation after the block's forward "
                f"(shape {tuple(item.shape)}, version {item.version} -> {written}); autograd needs its value "
                "from the forward. Write the modified value to a new tensor instead of in place.")
        if item.device_copy is None:
            self.counts["fetched_on_demand"] += 1
            self._fetch(item)
        out = item.device_copy
        if self._cuda:
            torch.cuda.current_stream(self._device).wait_event(item.fetched)
            out.record_stream(torch.cuda.current_stream(self._device))
        item.device_copy = None  # a second backward over the same graph (retain_graph) fetches again
        for ref in reversed(self._order[max(0, item.index - self._lookahead):item.index]):
            if (ahead := ref()) is not None and ahead.device_copy is None:
                self._fetch(ahead)
                self.counts["prefetched"] += 1
        return out

    def _fetch(self, item: _Offloaded) -> None:
        if not self._cuda:
            item.device_copy = item.host.clone()
            return
        with torch.cuda.stream(self._h2d):
            if item.copied is not None:
                self._h2d.wait_event(item.copied)
            item.device_copy = torch.empty(item.shape, dtype=item.dtype, device=self._device)
            item.device_copy.copy_(item.host, non_blocking=True)
            item.fetched = torch.cuda.Event()
            item.fetched.record(self._h2d)

    def stats(self) -> dict:
        return {**self.counts, "host": self._buffers.stats()}


def _outer_hooks_active() -> bool:
    """Whether saved-tensor hooks are active here (torch keeps a stack of them), or cannot be
    entered (torch refuses while they are disabled): either way the engine enters none."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except RuntimeError:
        return True


def _weak(tensor: torch.Tensor):
    try:
        return weakref.ref(tensor)
    except TypeError:
        return None


def _key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype
