"""Videos on the engine host: decoded with PyAV, sampled to frames, given to the model as images.

A prompt's ``videos`` column holds encoded clips (MP4, WebM: the bytes of the file), and its text
``<video>`` once per clip, where the clip goes. They travel as bytes to the host that needs them,
as images do (``multimodal.py``), and only there are decoded: frames are taken at
``data.video_fps`` frames per second of the clip, at most ``data.max_frames`` of them (spread evenly
over the clip when it has more), and each becomes an image of the prompt, in place of ``<video>``
the model's image placeholder once per frame. That is SmolVLM2's way with video (frames as
images); the Qwen-VL family's own video input (temporal patches of two frames) needs its video
processor, which needs torchvision, which has no build beside the CPU torch here (docs/vision.md).

Why PyAV: it is FFmpeg's Python binding, its wheels carry FFmpeg's decoders (H.264, MPEG-4, VP8/9,
AV1) so nothing is installed beside it, and it is what transformers' and torchvision's video
loaders use; decord has had no release since 2021, and OpenCV's wheel is three times the size for
a decoder and far more than we need.
"""

from __future__ import annotations

import io
import math

from engines.backends.multimodal import ImageError

MARKER = "<video>"  # a clip's place in a prompt's text


def frames(blob: bytes, fps: float, max_frames: int, where: str = "video", max_seconds: float | None = None) -> list[bytes]:
    """The frames of an encoded clip to give the model, as PNG bytes: the frame showing at every
    ``1 / fps`` seconds from the clip's start, at most ``max_frames`` (then spread evenly over the
    clip), or an ``ImageError`` naming ``where`` for a clip that does not decode, has no frame, or
    runs longer than ``max_seconds`` (read from the container before anything is decoded). One
    pass; only the frames taken are kept."""
    import av

    try:
        with av.open(io.BytesIO(blob)) as container:
            seconds = container.duration / av.time_base if container.duration else None
            if seconds is None:  # a container that does not say: count the frames' times first
                seconds = _seconds(list(f.time or 0.0 for f in container.decode(video=0)))
                container.seek(0)
            if max_seconds is not None and seconds > max_seconds:
                raise ImageError(f"{where}: {seconds:.1f} s long, over data.max_video_seconds={max_seconds:g}")
            wanted = [k / fps for k in range(max(1, math.ceil(seconds * fps - 1e-6)))]
            if len(wanted) > max_frames:  # more than allowed: spread over the clip
                wanted = [seconds * (k + 0.5) / max_frames for k in range(max_frames)]
            taken, showing = [], None
            for frame in container.decode(video=0):
                while len(taken) < len(wanted) and showing is not None and (frame.time or 0.0) > wanted[len(taken)] + 1e-6:
                    taken.append(showing)  # the frame on screen at the wanted time
                if len(taken) == len(wanted):
                    break
                showing = frame.to_image()
            if showing is not None:
                taken += [showing] * (len(wanted) - len(taken))  # the last frame shows to the end
    except ImageError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, StopIteration) as e:
        raise ImageError(f"{where}: not a decodable video ({type(e).__name__}: {e})") from None
    if not taken:
        raise ImageError(f"{where}: a video without frames")
    out = []
    for image in taken:
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _seconds(times: list[float]) -> float:
    """A clip's length from its frames' times: the last one's, plus one frame."""
    if not times:
        return 0.0
    return times[-1] + (times[-1] - times[-2] if len(times) > 1 else 0.0)


def check_video(blob: bytes, where: str, max_bytes: int, max_seconds: float) -> None:
    """A clip within ``max_bytes`` whose container opens, holds a video stream and says it is at most
    ``max_seconds`` long, else an ``ImageError`` naming ``where`` (the file, prompt_id and clip
    index). Nothing is decoded: a pass over every clip of a dataset costs about a read of its bytes
    (``frames`` decodes, when the host first reads the row)."""
    import av

    if len(blob) > max_bytes:
        raise ImageError(f"{where}: {len(blob):,} bytes, over data.max_video_bytes={max_bytes:,}")
    try:
        with av.open(io.BytesIO(blob)) as container:
            if not container.streams.video:
                raise ImageError(f"{where}: a file without a video stream")
            seconds = container.duration / av.time_base if container.duration else None
    except ImageError:
        raise
    except (av.error.FFmpegError, ValueError) as e:
        raise ImageError(f"{where}: not a decodable video ({type(e).__name__}: {e})") from None
    if seconds is not None and seconds > max_seconds:
        raise ImageError(f"{where}: {seconds:.1f} s long, over data.max_video_seconds={max_seconds:g}")


def expand(texts: list[str], images: list[bytes], clips: list[list[bytes]], image_token: str,
           frame_text: str | None = None) -> tuple[list[str], list[bytes]]:
    """A prompt's texts (its text, or its turns' in order) and images with each ``<video>`` replaced
    by ``frame_text`` (default ``image_token``: the model's image placeholder) once per frame of its
    clip (``clips``: each clip's frames, in the order of the markers), the frames put among the
    images in the order their places have in the text."""
    out_texts, out_images, used, clip = [], [], 0, 0
    for text in texts:
        pieces = text.split(MARKER)
        for k, piece in enumerate(pieces):
            n = piece.count(image_token)
            out_images += images[used : used + n]
            used += n
            if k < len(pieces) - 1:
                out_images += clips[clip]
                pieces[k] = piece + (frame_text or image_token) * len(clips[clip])
                clip += 1
        out_texts.append("".join(pieces))
    return out_texts, out_images + images[used:]


def markers(text: str) -> int:
    """How many clips a prompt's text places."""
    return text.count(MARKER)
