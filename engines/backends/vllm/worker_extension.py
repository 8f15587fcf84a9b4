"""Methods added to vLLM's worker (``LLM(worker_extension_cls=...)``), called by name through
``llm.collective_rpc``: a name crosses to an engine in its own process where a function would
need vLLM's insecure (pickled) serialisation."""

from __future__ import annotations

import os
from pathlib import Path


class WorkerExtension:
    def load_buckets(self, buckets=None, folder: str | None = None) -> list[str]:
        """A weight sync (``VLLMGenerator.update_weights``): Hugging Face-named tensors in buckets,
        passed by reference (``buckets``, an engine in the caller's process) or streamed as
        safetensors files through ``folder`` (``_streamed``). They go through vLLM's layerwise
        reload in one pass (vLLM's ``reload_weights``, which only logs a parameter that got no
        tensor: here that is an error). Answers each bucket's fingerprint as received: each tensor reduced
        where it is (``digest.BucketDigest``) just before the loader reads it."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from engines.backends.base import WeightSyncError, refuse_unwritten
        from engines.backends.digest import BucketDigest, sync_check

        digests: list[BucketDigest] = []
        mode = sync_check()

        def tensors():
            source = buckets if folder is None else _streamed(folder, self.rank)
            for bucket in source:
                digests.append(digest := BucketDigest(mode))
                for name, tensor in bucket:
                    digest.add(name, tensor)
                    yield name, tensor

        runner = self.model_runner
        model = runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                loaded = model.load_weights(tensors())
            except (KeyError, ValueError) as e:  # vLLM's loaders: a name the model has no parameter for
                raise WeightSyncError(f"weight sync: the rollout engine refused a tensor: {e}") from None
            finally:  # also after a refusal: layers that got nothing go back to their kernel tensors
                finalize_layerwise_reload(model, runner.model_config)
        refuse_unwritten({name for name, _ in model.named_parameters()} - set(loaded))
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        self.repack_tied_output_layer()
        self.repack_experts()
        return [d.hexdigest() for d in digests]

    def repack_tied_output_layer(self) -> bool:
        """After a reload, repack the output layer of a model whose output layer is tied to its
        input embeddings (the small Qwen2.5/Qwen3, Llama 3.2 and Gemma 3 models).

        vLLM's CPU backend computes the logits from a packed copy of the lm_head weight (oneDNN or
        sgl-kernel, made when the model loads). A tied lm_head receives no tensor of its own on a
        reload (the checkpoint has no lm_head.weight), so vLLM leaves its packed copy as it was:
        the embeddings take the new weights and the logits keep the old ones (log-probs off by
        ~2 nats after one step of a tiny model, tests/test_architectures.py). Answers whether it repacked."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if weight is None or weight.device.type != "cpu" or not hasattr(head, "quant_method"):
            return False  # on CUDA the unquantized lm_head reads its weight directly
        tied = any(p is weight for name, p in model.named_parameters(remove_duplicate=False) if not name.startswith("lm_head."))
        if tied:
            head.quant_method.process_weights_after_loading(head)
        return tied

    def repack_experts(self) -> int:
        """After a reload, prepack a mixture-of-experts model's expert weights again (CPU backend).

        vLLM's CPU MoE kernel computes from a grouped-GEMM layout of the experts' weights made when
        the model loads. A weight update copies the new weights in plain layout and, seeing a kernel
        already built, skips that step (vLLM 0.32, ``UnquantizedFusedMoEMethod._setup_kernel``): every
        fingerprint matches and the experts compute from garbage (a tiny Qwen3-MoE's log-probs off by
        ~3 nats after re-sending its own weights, tests/test_architectures.py). On CUDA the unquantized
        kernels read the weights as they are. Answers how many layers it repacked."""
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        layers = [m for m in self.model_runner.model.modules()
                  if isinstance(m, RoutedExperts) and m.w13_weight.device.type == "cpu"]
        for layer in layers:
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        return len(layers)


def _streamed(folder: str, rank: int):
    """The bucket files ``VLLMGenerator._stream`` writes, in order, as they appear, each read into
    host memory (the engine's loaders move it to its device) and marked read by this worker; until
    the file ``end`` says how many there are. (A writer that hangs is the controller's to time out:
    ``rollout.sync_timeout_s``.)"""
    import time

    from safetensors import safe_open

    k = 0
    while True:
        path = os.path.join(folder, f"bucket-{k:06d}.safetensors")
        if os.path.exists(path):
            with safe_open(path, framework="pt") as f:
                bucket = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118 (not a dict)
            Path(f"{path[: -len('.safetensors')]}.read-{rank}").touch()
            yield bucket
            k += 1
        elif (end := Path(folder, "end")).exists() and int(end.read_text()) <= k:
            return
        else:
            time.sleep(0.002)
