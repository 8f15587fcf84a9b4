"""The vision demo's task: read two digits off a picture and add them.

A prompt is the picture and the text ``"<image>sum:"``; the picture shows two digits side by
side, drawn here with PIL at a jittered position and ink. The answer reads them, then adds them
as the text demo writes sums (``engines/demo/arithmetic.py``: two digits, least-significant
first): ``"7+5=21"``. Reading first is what lets a tiny model generalise to pictures it has not
seen: asked for the sum alone, it memorised its training pictures (held-out 20% at a training
loss of 0.1), while reading alone reaches 92% held-out in 200 SFT steps.

The SFT teacher reads right but forgets the carry most of the time (``"7+5=20"``), so the
warm-started policy answers the ~45% of pairs that sum to 10 or more wrongly: RL with the
exact-match rule has something real to fix, through the digits it reads off the picture.

Held-out prompts are pictures never trained on (other jitter and ink); the 100 digit pairs
appear on both sides, drawn differently.
"""

from __future__ import annotations

import io
import random

from engines.demo.arithmetic import forgot_to_carry, problem

PROMPT = "<image>sum:"
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


def make_problems(count: int, seed: int) -> list[tuple[str, list[bytes], str, tuple[int, int]]]:
    """``count`` problems: (prompt text, [PNG], answer, (a, b)), the digit pairs cycling through all
    100 in a shuffled order so that every pair is seen, each drawn with its own jitter."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    out = []
    while len(out) < count:
        rng.shuffle(pairs)
        for a, b in pairs[: count - len(out)]:
            out.append((PROMPT, [draw_digits(a, b, rng)], teacher_answer(a, b, slip=False), (a, b)))
    return out


def teacher_answer(a: int, b: int, slip: bool) -> str:
    """The digits read, then their sum: right, or with the carry forgotten."""
    question = f"{a}+{b}="
    return question + (forgot_to_carry(question) if slip else problem(a, b, 1)[1])
