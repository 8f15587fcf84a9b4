"""Videos: clips decoded with PyAV and sampled to frames (engines/backends/video.py), bad clips
named before they train, and a prompt's ``<video>`` expanded into image placeholders."""

from __future__ import annotations

import io

import pytest

from engines.backends import video
from engines.backends.multimodal import ImageError

SHADES = [(250, 0, 0), (0, 250, 0), (0, 0, 250), (250, 250, 0), (0, 250, 250)]  # one colour per source frame


def clip(codec: str = "libx264", fmt: str = "mp4", fps: int = 2, shades=SHADES) -> bytes:
    import av
    from PIL import Image

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for shade in shades:
            for packet in stream.encode(av.VideoFrame.from_image(Image.new("RGB", (32, 32), shade))):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def shades_of(pngs: list[bytes]) -> list[int]:
    """Which of SHADES each decoded frame shows (the nearest colour)."""
    from PIL import Image

    out = []
    for png in pngs:
        pixel = Image.open(io.BytesIO(png)).convert("RGB").getpixel((16, 16))
        out.append(min(range(len(SHADES)), key=lambda k: sum((a - b) ** 2 for a, b in zip(pixel, SHADES[k]))))
    return out


@pytest.mark.parametrize("codec, fmt", [("libx264", "mp4"), ("libvpx-vp9", "webm")])
def test_frames_are_taken_at_the_rate_asked_and_spread_when_there_are_too_many(codec, fmt):
    blob = clip(codec, fmt)  # 5 frames at 2 per second: 2.5 s, frame k on screen from k/2 s
    assert shades_of(video.frames(blob, fps=2, max_frames=8)) == [0, 1, 2, 3, 4]
    assert shades_of(video.frames(blob, fps=1, max_frames=8)) == [0, 2, 4]  # at 0, 1 and 2 s
    assert shades_of(video.frames(blob, fps=2, max_frames=2)) == [1, 3]  # at 0.625 and 1.875 s: evenly over the clip
    assert shades_of(video.frames(blob, fps=0.25, max_frames=8)) == [0]  # a clip shorter than one interval: its first frame


def test_bad_clips_are_named():
    where = "prompts.parquet (prompt_id 7): field 'videos'[0]"
    junk = b"\x00\x00\x00\x18ftypmp42" + bytes(200)
    for check in (lambda: video.frames(junk, 1, 8, where), lambda: video.check_video(junk, where, 1 << 20, 60)):
        with pytest.raises(ImageError, match=r"prompt_id 7\): field 'videos'\[0\]: not a decodable video"):
            check()
    for check in (lambda: video.frames(clip(), 1, 8, where, max_seconds=2), lambda: video.check_video(clip(), where, 1 << 20, 2)):
        with pytest.raises(ImageError, match=r"field 'videos'\[0\]: 2.5 s long, over data.max_video_seconds=2"):
            check()
    with pytest.raises(ImageError, match=r"field 'videos'\[0\]: [\d,]+ bytes, over data.max_video_bytes=100"):
        video.check_video(clip(), where, max_bytes=100, max_seconds=60)
    video.check_video(clip(), where, 1 << 20, 60)


def test_a_prompts_videos_become_placeholders_and_images_in_text_order():
    texts, images = video.expand(["<image>then<video>and", "<image><video>?"], [b"i0", b"i1"], [[b"a0", b"a1"], [b"b0"]],
                                 "<image>")
    assert texts == ["<image>then<image><image>and", "<image><image>?"]
    assert images == [b"i0", b"a0", b"a1", b"i1", b"b0"]
    texts, images = video.expand(["<video><|image_pad|>"], [b"i0"], [[b"a0"]], "<|image_pad|>", "<s><|image_pad|></s>")
    assert texts == ["<s><|image_pad|></s><|image_pad|>"] and images == [b"a0", b"i0"]


def test_bad_videos_fail_before_engines_load_and_a_row_is_read_as_frames(tmp_path):
    from test_vision import config_for, save_tiny_vlm, write_prompts

    from engines.demo import vision
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama
    from engines.host import validation
    from engines.host.prompts import Frames, PromptStream

    vlm = save_tiny_vlm(tmp_path / "vlm")
    (prompt, clips, answer, _), = vision.make_video_problems(1, seed=0)  # 2 s: one digit a second
    good = {"prompt_id": 7, "prompt": prompt, "answer": answer, "videos": clips}
    ok = write_prompts(tmp_path / "ok.parquet", [good | {"prompt_id": i} for i in range(3)] + [good])
    config = config_for(tmp_path, vlm, ok)
    assert validation.validate_inputs(config) == {"data.prompts": 4}

    cases = {
        "no-marker": ([good | {"prompt": "sum:"}], r"prompt_id 7: field 'prompt' has 0 video marker\(s\) '<video>' and field 'videos' 1"),
        "no-column": ([{k: v for k, v in good.items() if k != "videos"}], r"prompt_id 7.*has no 'videos' column"),
        "junk-row-3": ([good | {"prompt_id": i} for i in range(3)] + [good | {"videos": [b"\x00junk" * 40]}],
                       r"prompt_id 7\): field 'videos'\[0\]: not a decodable video"),
    }
    for name, (rows, pattern) in cases.items():
        path = write_prompts(tmp_path / f"{name}.parquet", rows)
        with pytest.raises(validation.InputError, match=pattern) as e:
            validation.validate_inputs(config_for(tmp_path, vlm, path))
        assert path in str(e.value)
    for override, pattern in (("data.max_video_seconds=1.5", r"'videos'\[0\]: 2.0 s long, over data.max_video_seconds=1.5"),
                              ("data.max_video_bytes=100", r"'videos'\[0\]: [\d,]+ bytes, over data.max_video_bytes=100")):
        with pytest.raises(validation.InputError, match=r"prompt_id 0\): field " + pattern):
            validation.validate_inputs(config_for(tmp_path, vlm, ok, override))
    text_model = tmp_path / "text-model"
    tokenizer = build_char_tokenizer()
    build_tiny_llama(len(tokenizer), hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1).save_pretrained(text_model)
    tokenizer.save_pretrained(text_model)
    with pytest.raises(validation.InputError, match="field 'videos' holds 1 video.*prompt_id 0.*text-only model"):
        validation.validate_inputs(config_for(tmp_path, str(text_model), ok))

    # on the host: the clip's two seconds are two frames, each an image of the prompt in place of <video>
    from engines.backends.multimodal import load_processor

    stream = PromptStream(ok, 0, 1, frames=Frames.of(config.data, load_processor(vlm)))
    row, = stream.wave(0, 1)
    assert row["prompt"] == "<image><image>sum:" and row["images"] == video.frames(clips[0], 1.0, 8)
    assert stream.images([0]) == [row["images"]]  # the trainer's host reads the same frames by the row
    half = Frames.of(config.data.model_copy(update={"video_fps": 0.5}), load_processor(vlm))
    assert PromptStream(ok, 0, 1, frames=half).wave(0, 1)[0]["prompt"] == "<image>sum:"  # one frame per 2 s: the first only
