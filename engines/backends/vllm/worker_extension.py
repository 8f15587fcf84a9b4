"""Methods added to vLLM's worker (``LLM(worker_extension_cls=...)``), called by name through
``llm.collective_rpc``: a name crosses to an engine in its own process where a function would
need vLLM's insecure (pickled) serialisation."""

from __future__ import annotations


class WorkerExtension:
    def repack_tied_output_layer(self) -> bool:
        """After ``reload_weights``, repack the output layer of a model whose output layer is tied
        to its input embeddings (the small Qwen2.5/Qwen3, Llama 3.2 and Gemma 3 models).

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
