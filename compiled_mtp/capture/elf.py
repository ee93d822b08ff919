"""The shared libraries an ELF shared object names as its dependencies (its DT_NEEDED entries)."""

from __future__ import annotations

import struct

_MAGIC = b"\x7fELF"
# Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize; Elf64_Dyn: tag, value
_SECTION, _DYN = struct.Struct("<IIQQQQIIQQ"), struct.Struct("<qQ")
_SHT_DYNAMIC, _DT_NULL, _DT_NEEDED = 6, 0, 1


def is_elf64(data: bytes) -> bool:
    """A 64-bit little-endian ELF file (what Inductor builds on x86-64 and aarch64 Linux)."""
    return data[:4] == _MAGIC and data[4] == 2 and data[5] == 1


def needed(data: bytes) -> list[str]:
    """The names in the dynamic section's DT_NEEDED entries of an ELF64 little-endian file."""
    if not is_elf64(data):
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [_SECTION.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    names: list[str] = []
    for _, kind, _, _, offset, size, link, *_ in sections:
        if kind != _SHT_DYNAMIC:
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, _DYN.size):
            tag, value = _DYN.unpack_from(data, at)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strings + value)
                names.append(data[strings + value : end].decode())
    return names
