"""The vision demo's task: read two digits off a picture and add them.

A prompt is the picture and the text ``"<image>sum:"`` (``<image>``: the policy's image
placeholder); the picture shows two digits side by side, drawn here with PIL at a jittered
position and ink. The answer reads them, then adds them
as the text demo writes sums (``engines/demo/arithmetic.py``: two digits, least-significant
first): ``"7+5=21"``. Reading first is what lets a tiny model generalise to pictures it has not
seen: asked for the sum alone, it memorised its training pictures (held-out 20% at a training
loss of 0.1), while reading alone reaches 92% held-out in 200 SFT steps.

The SFT teacher reads right but forgets the carry most of the time (``"7+5=20"``), so the
warm-started policy answers the ~45% of pairs that sum to 10 or more wrongly: RL with the
exact-match rule has something real to fix, through the digits it reads off the picture.

Held-out prompts are pictures never trained on (other jitter and ink); the 100 digit pairs
appear on both sides, drawn differently.

The video task (``prepare.task=video``) asks the same of a clip: an MP4 of two seconds whose first
second shows the first digit and whose second second the other, so the answer needs a frame other
than the first (``make_video_problems``; the prompt is ``"<video>sum:"``).
"""

from __future__ import annotations

import io
import random

from engines.demo.arithmetic import forgot_to_carry, problem

PROMPT = "<image>sum:"  # with Idefics3's placeholder
SIZE = 56  # pixels: the tiny model's image size (engines/demo/tiny_vision.py)


def draw_digits(a: int, b: int, rng: random.Random) -> bytes:
    """A PNG of ``a`` and ``b`` side by side on a light canvas, position and ink jittered."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=30)
    image = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(215, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for x0, digit in ((1, a), (29, b)):
        ink = tuple(rng.randint(0, 90) for _ in range(3))
        draw.text((x0 + rng.randint(0, 5), rng.randint(0, 14)), str(digit), fill=ink, font=font)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def draw_digit(d: int, rng: random.Random):
    """One digit on a light canvas (a PIL image), position and ink jittered: a frame of the video task."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(215, 255) for _ in range(3)))
    ink = tuple(rng.randint(0, 90) for _ in range(3))
    ImageDraw.Draw(image).text((12 + rng.randint(0, 14), rng.randint(0, 14)), str(d), fill=ink,
                               font=ImageFont.load_default(size=30))
    return image


def encode_clip(frames: list, fps: int = 1) -> bytes:
    """``frames`` (PIL images) as an H.264 MP4 at ``fps`` frames per second, near-lossless."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "10"})
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode())
    return out.getvalue()


def make_video_problems(count: int, seed: int) -> list[tuple[str, list[bytes], str, tuple[int, int]]]:
    """``count`` problems of the video task: (``"<video>sum:"``, [MP4], answer, (a, b)): a clip of
    two seconds at one frame per second, ``a`` then ``b``; the pairs cycle as in ``make_problems``."""
    rng = random.Random(seed)
    return [("<video>sum:", [encode_clip([draw_digit(a, rng), draw_digit(b, rng)])], teacher_answer(a, b, slip=False), (a, b))
            for a, b in digit_pairs(count, rng)]


def make_problems(count: int, seed: int, placeholder: str = "<image>") -> list[tuple[str, list[bytes], str, tuple[int, int]]]:
    """``count`` problems: (prompt text, [PNG], answer, (a, b)), the digit pairs cycling through all
    100 in a shuffled order so that every pair is seen, each drawn with its own jitter; the prompt
    holds ``placeholder``, the policy's image placeholder (Idefics3's by default)."""
    rng = random.Random(seed)
    prompt = PROMPT.replace("<image>", placeholder)
    return [(prompt, [draw_digits(a, b, rng)], teacher_answer(a, b, slip=False), (a, b)) for a, b in digit_pairs(count, rng)]


def digit_pairs(count: int, rng: random.Random):
    """``count`` digit pairs (a, b), cycling through all 100 in an order shuffled anew each cycle;
    the caller draws with ``rng`` between them (a generator: its shuffles and the drawings take
    turns on the same generator)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    for k in range(count):
        if k % len(pairs) == 0:
            rng.shuffle(pairs)
        yield pairs[k % len(pairs)]


def teacher_answer(a: int, b: int, slip: bool) -> str:
    """The digits read, then their sum: right, or with the carry forgotten."""
    question = f"{a}+{b}="
    return question + (forgot_to_carry(question) if slip else problem(a, b, 1)[1])
