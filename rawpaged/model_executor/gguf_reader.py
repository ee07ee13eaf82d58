"""``gguf.GGUFReader`` with its metadata parsed in bulk from a plain ``ndarray`` view of the file's map.

The library reads a metadata array one element at a time, each a slice of its ``np.memmap`` (and each
slice of a memmap subclass runs ``memmap.__array_finalize__``): for Gemma 3's 262,144-piece vocabulary
(pieces, scores and token types, about a million values) that was 11 s of a 14 s load. Here a plain view
of the same map (same memory, still read lazily from the file) is sliced instead, and an array of numbers
is read in one slice, then cut into the one-element parts the library's ``ReaderField`` holds. The fields
and tensors are the library's own types with the same contents
(``tests/model_executor/test_gguf_reader.py`` compares every field and tensor with the library's reader).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np


def fast_reader_class(gguf: Any) -> type:
    """A subclass of ``gguf.GGUFReader`` (``gguf``: the imported module) that overrides the two private
    primitives its parsing goes through: ``_get`` (a value at an offset) and ``_get_field_parts`` (for
    arrays of numbers and of strings; other types go to the library's)."""
    value_type = gguf.GGUFValueType

    class FastGGUFReader(gguf.GGUFReader):
        def _plain_view(self) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            return plain

        def _get(self, offset, dtype, count=1, override_order=None):
            dt = np.dtype(dtype)
            count = int(count)
            arr = self._plain_view()[offset : offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            if value_type(raw_type) != value_type.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype = value_type(raw_itype[0])
            offs, n = orig_offs + 12, int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                parts = [raw_itype, alen, *values.reshape(n, 1)]
                return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [value_type.ARRAY, itype]
            if itype != value_type.STRING or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            return self._string_array(orig_offs, raw_itype, alen, n)

        def _string_array(self, orig_offs, raw_itype, alen, n):
            """Parts of an array of ``n`` strings as the library makes them (a uint64 length, then the
            bytes, per string), the lengths read with ``struct`` (native byte order only)."""
            plain = self._plain_view()
            raw = memoryview(plain)
            parts, idxs, offs = [raw_itype, alen], [], orig_offs + 12
            for _ in range(n):
                (slen,) = struct.unpack_from("=Q", raw, offs)
                parts += (plain[offs : offs + 8].view(np.uint64), plain[offs + 8 : offs + 8 + slen])
                idxs.append(len(parts) - 1)
                offs += 8 + slen
            return offs - orig_offs, parts, idxs, [value_type.ARRAY, value_type.STRING]

    return FastGGUFReader
