"""The fast packer and unpacker against the pure-Python specification."""

from __future__ import annotations

import pytest
import torch

from fedddl.commands._bench_baselines import naive_pack
from fedddl.compression import CODECS, pack_codes, unpack_codes
from fedddl.compression.backends.packing import find_invalid_codes, packed_size
from tests.support.reference import python_pack, python_unpack

_SIZES = [0, 1, 3, 4, 5, 7, 19, 20, 1001]


def _random_signs(numel: int, seed: int) -> torch.Tensor:
    return torch.randint(-1, 2, (numel,), generator=torch.Generator().manual_seed(seed))


def _codes(signs: torch.Tensor) -> torch.Tensor:
    return torch.where(signs < 0, 2, signs).to(torch.uint8)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", _SIZES)
def test_pack_matches_python_reference(codec: str, numel: int) -> None:
    signs = _random_signs(numel, numel)
    packed = pack_codes(_codes(signs), codec)
    assert bytes(packed.numpy()) == python_pack(signs.tolist(), codec)
    assert packed.numel() == packed_size(numel, codec)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", _SIZES)
def test_unpack_matches_python_reference(codec: str, numel: int) -> None:
    signs = _random_signs(numel, numel + 1)
    data = python_pack(signs.tolist(), codec)
    packed = torch.tensor(list(data), dtype=torch.uint8)
    out = unpack_codes(packed, numel, 2.5, codec)
    expected = torch.tensor(python_unpack(data, numel, codec), dtype=torch.float32) * 2.5
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert find_invalid_codes(packed, numel, codec) is None


def test_naive_pack_agrees() -> None:
    signs = _random_signs(1003, 0)
    assert bytes(naive_pack(signs).numpy()) == python_pack(signs.tolist(), "2bit")


def test_every_byte_value_unpacks_like_the_reference() -> None:
    every = torch.arange(256, dtype=torch.uint8)
    valid = [b for b in range(256) if all((b >> (2 * k)) & 3 != 3 for k in range(4))]
    out = unpack_codes(every, 1024, 1.0, "2bit").view(256, 4)
    for byte in valid:
        assert out[byte].tolist() == python_unpack(bytes([byte]), 4, "2bit")
    assert len(valid) == 81


@pytest.mark.parametrize("position", [0, 5, 8, 13, 63])
def test_code_0b11_is_found_anywhere(position: int) -> None:
    packed = torch.zeros(17, dtype=torch.uint8)
    packed[position // 4] = 0b11 << (2 * (position % 4))
    assert find_invalid_codes(packed, 17 * 4, "2bit") == "invalid ternary code 0b11"


def test_base3_invalid_byte_and_padding() -> None:
    packed = torch.tensor([0, 243], dtype=torch.uint8)
    assert "243" in str(find_invalid_codes(packed, 10, "base3"))
    # 7 values: the last byte holds 2 trits, so it must be < 9
    assert "padding" in str(find_invalid_codes(torch.tensor([0, 9], dtype=torch.uint8), 7, "base3"))
    assert find_invalid_codes(torch.tensor([0, 8], dtype=torch.uint8), 7, "base3") is None


def test_2bit_nonzero_padding_is_found() -> None:
    packed = torch.tensor([0b01_00_00_00], dtype=torch.uint8)  # slot 3 used, numel 3
    assert "padding" in str(find_invalid_codes(packed, 3, "2bit"))
    assert find_invalid_codes(packed, 4, "2bit") is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="0, 1 or 2"):
        pack_codes(torch.tensor([3], dtype=torch.uint8))
    with pytest.raises(ValueError, match="codec"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), "base9")
    with pytest.raises(ValueError, match="code bytes"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 4, 1.0)
