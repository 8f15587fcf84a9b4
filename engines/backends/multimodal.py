"""Images on the engine host: decoding, the processor's pixel tensors, the image tokens.

Images travel as encoded bytes (PNG/JPEG) from the prompts Parquet to the host that needs them,
and only there become pixels: the processor of the model's Hugging Face folder (its
``processor_config.json`` / ``preprocessor_config.json``) turns them into the tensors the vision
tower takes. Nothing here is model-specific: the processor knows its model's placeholder, its
expansion into image tokens and its pixel layout.

Prompt ids: a vision prompt's text holds the model's image placeholder once per image; the
processor expands each into the image tokens the language model sees. Rollout rows and
``TrainBatch`` carry the *expanded* ids (what the model computes on). vLLM is given the
unexpanded ids (one placeholder per image) and expands them itself: ids it is given already
expanded it would expand again, silently (OpenRLHF #1220, TRL #6294).
"""

from __future__ import annotations

import io
import warnings

import torch


class ImageError(ValueError):
    """An image that cannot be used; the message names where it came from."""


def is_vision_config(config) -> bool:
    """A Hugging Face config of a vision-language model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def load_processor(model_dir: str):
    """The folder's processor (tokenizer + image processor), or None for a text-only folder.

    Where the processor's video processor cannot be built because torchvision is missing (the
    Qwen-VL family's on these CPU machines: torchvision has no build beside the CPU torch), the
    same processor class is built for images only (``images_only``): the image processor's PIL
    backend, which transformers ships for these families, and no video processor."""
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(model_dir)
    if not is_vision_config(config):
        return None
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        processor = images_only_processor(model_dir, config.model_type)
    if not hasattr(processor, "image_processor"):
        raise ImageError(f"{model_dir}: a vision-language model whose folder has no image processor "
                         "(processor_config.json or preprocessor_config.json)")
    return processor


def images_only(processor_class: type) -> type:
    """``processor_class`` (a transformers processor with a video processor) that takes
    ``video_processor=None``: it processes text and images as the full one does, and saves what it
    has (tokenizer, image processor, chat template), which the full class loads back where
    torchvision is installed. A video given to it fails in its video processor."""

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):
            import json
            import os

            os.makedirs(save_directory, exist_ok=True)
            self.tokenizer._set_processor_class(processor_class.__name__)
            self.tokenizer.save_pretrained(save_directory)
            self.image_processor.save_pretrained(save_directory)
            if isinstance(self.chat_template, str):
                with open(os.path.join(save_directory, "chat_template.jinja"), "w") as f:
                    f.write(self.chat_template)
            with open(os.path.join(save_directory, "processor_config.json"), "w") as f:
                json.dump({"processor_class": processor_class.__name__}, f)
            return [save_directory]

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{processor_class.__name__}ImagesOnly"
    return ImagesOnly


def images_only_processor(model_dir: str, model_type: str):
    """``model_dir``'s processor class (by ``model_type``), built for images only (``images_only``)."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = images_only(getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return cls(image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil"), tokenizer=tokenizer,
               video_processor=None, chat_template=getattr(tokenizer, "chat_template", None))


def decode(blob: bytes, where: str = "image"):
    """Encoded bytes → an RGB PIL image, or an ``ImageError`` naming ``where``. Images are checked
    (``check_image``: their declared pixels within ``data.max_image_pixels``) as their rows are read;
    PIL's own guard (``Image.MAX_IMAGE_PIXELS``, ~89M; twice that an error) stands behind it."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(blob))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: not a decodable image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def check_image(blob: bytes, where: str, max_bytes: int, pixels: bool = False, max_pixels: int | None = None) -> None:
    """An encoded image within ``max_bytes`` whose header declares at most ``max_pixels`` pixels
    (width x height, read from the header before anything is decoded: a 164 KB PNG can declare
    13000 x 13000, a gigabyte decoded) and whose header and structure are sound (PIL's ``verify``:
    the format, the size, every chunk's checksum for a PNG; no pixels decoded, so a pass over every
    image of a dataset costs about a read of its bytes), and with ``pixels`` one that decodes; else an
    ``ImageError`` naming ``where`` (the file, prompt_id and image index)."""
    from PIL import Image

    if len(blob) > max_bytes:
        raise ImageError(f"{where}: {len(blob):,} bytes, over data.max_image_bytes={max_bytes:,}")
    try:
        with warnings.catch_warnings():  # (PIL's DecompressionBombWarning: the limit below says it, naming the image)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(blob))  # the header only: the size, nothing decoded
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageError(f"{where}: {width} x {height} = {width * height:,} pixels, over data.max_image_pixels="
                             f"{max_pixels:,} ({width * height * 3 / 2**20:,.0f} MiB decoded as RGB): "
                             "resize it, or raise data.max_image_pixels")
        image.verify()
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises several kinds (SyntaxError for a bad PNG checksum)
        raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    if pixels:
        decode(blob, where)


def image_token_ids(processor) -> list[int]:
    """The special tokens a processor puts around and in place of images (and videos): never to be
    generated (a sampled video placeholder would send a Qwen-VL's trainer looking for a video)."""
    tok = processor.tokenizer
    names = [getattr(processor, a, None) for a in ("image_token", "video_token", "fake_image_token", "global_image_tag",
                                                   "vision_start_token", "vision_end_token", "boi_token", "eoi_token")]
    ids = {tok.convert_tokens_to_ids(n) for n in names if isinstance(n, str)}
    return sorted(i for i in ids if i is not None and i != tok.unk_token_id)


def placeholder(processor) -> str:
    """The text that stands for one image in a prompt (e.g. ``<image>``)."""
    return processor.image_token


def image_text(processor) -> str:
    """One image in a prompt's text as the model's chat template writes it: the placeholder, inside
    the family's vision start and end tokens where it has them (Qwen-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``). A video's frames are put in this way."""
    vocab = processor.tokenizer.get_vocab()
    if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab:
        return "<|vision_start|>" + processor.image_token + "<|vision_end|>"
    return processor.image_token


def model_inputs(processor, prompts: list[str], images: list[list[bytes]], padding_side: str = "left",
                 **text_kwargs) -> dict:
    """The processor's batch for ``prompts`` and their images: expanded ``input_ids``, the
    attention mask and the pixel tensors, padded on ``padding_side`` (``text_kwargs`` go to its
    tokenizer: ``add_special_tokens=False`` for prompts rendered by a chat template)."""
    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, padding_side
    try:
        decoded = [[decode(b) for b in row] for row in images]
        return processor(text=prompts, images=decoded, padding=True, return_tensors="pt", **text_kwargs)
    finally:
        tok.padding_side = side


class PromptIds:
    """A vision prompt's ids as the processor expands them (image tokens in place of each
    placeholder), remembered by (text, image sizes): how many image tokens an image becomes
    depends on its size only, so SFT over thousands of examples of a few prompt shapes runs the
    processor's text side a few times."""

    def __init__(self, processor, **text_kwargs):
        self.processor, self.text_kwargs = processor, text_kwargs  # add_special_tokens=False: a rendered chat template
        self._ids: dict[tuple, list[int]] = {}

    def __call__(self, text: str, images: list[bytes]) -> list[int]:
        decoded = [decode(b) for b in images]
        key = (text, tuple(im.size for im in decoded))
        if key not in self._ids:
            self._ids[key] = list(self.processor(text=[text], images=[decoded] if decoded else None,
                                                 **self.text_kwargs)["input_ids"][0])
        return self._ids[key]


class PixelCache:
    """The processor's pixel tensors of each distinct image list, computed once and kept for as
    long as this object lives (the trainer keeps one per train step: the G samples of a prompt,
    its micro-batches and minibatches share one decode and one processing). ``keep=False``: no
    memory of earlier batches (SFT draws each batch afresh from the whole dataset)."""

    def __init__(self, processor, keep: bool = True):
        self.processor, self.keep = processor, keep
        self._cache: dict[tuple[bytes, ...], dict[str, torch.Tensor]] = {}

    def _one(self, images: tuple[bytes, ...]) -> dict[str, torch.Tensor]:
        if images in self._cache:
            return self._cache[images]
        out = self.processor.image_processor([[decode(b) for b in images]], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if self.keep:
            self._cache[images] = tensors
        return tensors

    def batch(self, images: list[list[bytes]], device) -> dict[str, torch.Tensor]:
        """The pixel inputs of a batch of sequences: each sequence's tensors joined along the first
        dimension (Idefics3's [sequence, image, ...] and Qwen-VL's [patch, ...] alike), a shorter
        image axis zero-padded (Idefics3 skips all-zero images)."""
        per_row = [self._one(tuple(row)) for row in images]
        out = {}
        for key in per_row[0]:
            tensors = [r[key] for r in per_row]
            if tensors[0].dim() > 1 and len({t.shape[1:] for t in tensors}) > 1:  # rows with fewer images
                width = max(t.shape[1] for t in tensors)
                tensors = [torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]) for t in tensors]
            out[key] = torch.cat(tensors).to(device)
        return out


def pixels(processor, batch, device, cache: PixelCache | None = None,
           input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
    """A trainer's pixel inputs for a ``TrainBatch`` with images (from ``cache``, which a trainer
    keeps for one train step), with ``input_ids``' token types where the model takes them
    (``token_types``), else None."""
    if batch.images is None:
        return None
    if processor is None:
        raise ValueError("a batch with images for a text-only policy")
    out = (cache or PixelCache(processor)).batch(batch.images, device)
    return out | token_types(processor, input_ids) if input_ids is not None else out


def token_types(processor, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids`` (0 text, 1 image, 2 video) where the processor gives them to its model,
    as it does inside ``generate()``: Qwen2.5-VL and later derive every token's 3-D rotary position
    from them and, without them, fall back to 1-D positions, so a trainer that left them out scored
    other positions than the rollout sampled at (3e-3 apart in log-probability on a tiny
    Qwen2.5-VL: the H200 run of 2026-11-27). Nothing for a processor that has none (Idefics3)."""
    if "mm_token_type_ids" not in getattr(processor, "model_input_names", ()):
        return {}
    types = processor.create_mm_token_type_ids(input_ids.tolist())
    return {"mm_token_type_ids": torch.tensor(types, device=input_ids.device)}


def is_vision_folder(model_dir: str) -> bool:
    """Whether a local Hugging Face folder holds a vision-language model (its config.json has a
    ``vision_config``), read without importing transformers (timing-stub hosts never load it)."""
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("vision_config") is not None
    except (OSError, ValueError):
        return False


def folder_model_type(model_dir: str) -> str | None:
    """A local Hugging Face folder's ``model_type`` (config.json), read without transformers."""
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
