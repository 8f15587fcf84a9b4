"""Megatron-Core on a machine without CUDA (tests only; the product targets CUDA).

Megatron-Core 0.16 calls CUDA directly where a CPU run needs none: ``torch.cuda.current_device()``
as the device of the rotary table and the DDP grad buffers, ``device='cuda'`` literals in the
optimizer, gradient clipping and checkpoint code, ``torch.cuda.synchronize()``, a CUDA RNG
tracker forked around every attention dropout, and ``Tensor.cuda()`` on a pipeline's tied output layer. The shim below makes each Megatron module see a
``torch`` whose CUDA is the CPU, and replaces the two things that cannot be redirected that way:
the RNG tracker (and the CUDA RNG state that activation recomputation saves and restores), and the
``tensor.type() == 'torch.cuda.FloatTensor'`` checks in gradient clipping and the distributed
optimizer.

Nothing outside ``megatron.*`` is touched (but ``torch.Tensor.type`` for the duration of those few
calls): transformers, vLLM and torch itself keep the real ``torch``. On a machine with CUDA the
shim does nothing.

``install()`` registers an import hook and patches Megatron modules already imported; it imports
neither torch nor Megatron itself, so ``megatron_cpu_site/sitecustomize.py`` can call it in every
Python process (engine hosts, the Prefect server) at no cost until Megatron is imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand", "randn",
)
_state: dict = {"installed": False, "torch": None, "active": None}


def install() -> None:
    """Idempotent: later Megatron imports are patched as they load, earlier ones now."""
    if _state["installed"]:
        return
    _state["installed"] = True
    sys.meta_path.insert(0, _MegatronFinder())
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            _patch(module)


def _active() -> bool:
    """Decided once, when the first Megatron module loads (torch is being imported then anyway)."""
    if _state["active"] is None:
        import torch

        _state["active"] = not torch.cuda.is_available()
    return _state["active"]


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of every ``megatron.*`` module so that it is patched right after it runs
    (before any later module copies its names with ``from ... import``)."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and pkgutil
        return getattr(self.loader, name)


def _patch(module) -> None:
    if not _active():
        return
    if "torch" in sys.modules and module.__dict__.get("torch") is sys.modules["torch"]:
        module.torch = _torch_on_cpu()
    name = module.__name__
    if name == "megatron.core.tensor_parallel.random":
        module.CudaRNGStatesTracker.add = _tracker_add
        module.CudaRNGStatesTracker.fork = _tracker_fork
        # activation recomputation saves and restores the CUDA RNG around each recomputed chunk
        # (beside the CPU RNG, which it handles itself, and is the only one a CPU run draws from)
        module._get_cuda_rng_state = _no_cuda_rng_state
        module._set_cuda_rng_state = _no_cuda_rng_state
    if name == "megatron.core.optimizer.clip_grads":
        module.clip_grad_by_total_norm_fp32 = _cuda_type_names(module.clip_grad_by_total_norm_fp32)
    if name == "megatron.core.optimizer.optimizer":
        # it took clip_grads' function by name; its bf16 optimizer sorts parameters by type name
        module.clip_grad_by_total_norm_fp32 = sys.modules["megatron.core.optimizer.clip_grads"].clip_grad_by_total_norm_fp32
        module.Float16OptimizerWithFloat16Params.__init__ = _cuda_type_names(module.Float16OptimizerWithFloat16Params.__init__)
    if name == "megatron.core.optimizer.distrib_optimizer":
        module.DistributedOptimizer.__init__ = _cuda_type_names(module.DistributedOptimizer.__init__)
        # a fully reshardable checkpoint moves each buffer's state ``.cuda()`` to all-gather it over DP
        gather = module.DistributedOptimizer.get_parameter_state_dp_zero
        module.DistributedOptimizer.get_parameter_state_dp_zero = _tensor_cuda_stays(gather)
    if name == "megatron.core.models.common.language_module.language_module":
        # a tied output layer on the last pipeline stage: its copy of the embedding goes ``.cuda()``
        # before the first and last stages all-reduce it
        setup = module.LanguageModule.setup_embeddings_and_output_layer
        module.LanguageModule.setup_embeddings_and_output_layer = _tensor_cuda_stays(setup)


def _torch_on_cpu():
    """One shared stand-in for ``torch`` in Megatron modules: CUDA devices mean the CPU."""
    if _state["torch"] is None:
        import functools
        import types

        import torch

        def cpu(device):
            if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
                return "cpu"
            if isinstance(device, torch.device) and device.type == "cuda":
                return "cpu"
            return device

        def on_cpu(factory):
            @functools.wraps(factory)
            def call(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = cpu(kwargs["device"])
                return factory(*args, **kwargs)

            return call

        class TorchOnCpu(types.ModuleType):
            def __getattr__(self, name):  # everything but the attributes set below
                return getattr(torch, name)

        class CudaOnCpu(types.SimpleNamespace):
            def __getattr__(self, name):
                return getattr(torch.cuda, name)

        stand_in = TorchOnCpu("torch")
        stand_in.cuda = CudaOnCpu(current_device=lambda: "cpu", synchronize=lambda *a, **k: None)
        for name in _FACTORIES:
            setattr(stand_in, name, on_cpu(getattr(torch, name)))
        _state["torch"] = stand_in
    return _state["torch"]


# --- RNG tracker: the engines run without dropout, so forking the CUDA RNG has nothing to protect.
def _tracker_add(self, name, seed):
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.seeds_.add(seed)
    self.states_[name] = seed


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    yield


def _no_cuda_rng_state(*args, **kwargs):
    return None


def _with_tensor_method(function, name: str, replacement):
    """``function`` with ``torch.Tensor.<name>`` replaced by ``replacement(original)`` for the duration of each call."""
    import functools

    import torch

    if getattr(function, "_cpu_shim", False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replacement(original))
        try:
            return function(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, original)

    call._cpu_shim = True
    return call


def _tensor_cuda_stays(function):
    """``function`` with ``Tensor.cuda()`` leaving a tensor where it is."""
    return _with_tensor_method(function, "cuda", lambda original: lambda tensor, *a, **k: tensor)


# --- Megatron tells fp32 from bf16 parameters (and asserts that grads are on the GPU) by comparing
# ``tensor.type()`` with 'torch.cuda.FloatTensor'; inside these calls CPU tensors answer so.
def _cuda_type_names(function):
    def cuda_type_names(type_name):
        def cuda_type_name(tensor, *a, **k):
            name = type_name(tensor, *a, **k)
            if a or k or tensor.device.type != "cpu":
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        return cuda_type_name

    return _with_tensor_method(function, "type", cuda_type_names)
