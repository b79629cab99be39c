"""A codec added the way a contributor would (its own class plus one registry line) runs through
the whole contract suite and the method grammar, with no table edited anywhere."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from codec_contract import CodecContract

from kvstrata.codecs import BF16, QTensor, get_codec
from kvstrata.codecs.blocks import check_finite
from kvstrata.methods import parse_method
from kvstrata.registry import REGISTRY, Tolerance, register, unregister


@dataclass(frozen=True)
class FP16(BF16):
    """Throwaway: float16 values (10 mantissa bits), no scales."""

    name: ClassVar[str] = "fp16test"
    summary: ClassVar[str] = "float16, 16 bits per element (a test codec)"

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype,
                       parts={"values": x.to(torch.float16).contiguous()})


@pytest.fixture(scope="class")
def codec_name():
    register(FP16, "store", tolerance=Tolerance(element=2**-10, logits=0.01))
    yield FP16.name
    unregister(FP16.name)


class TestThrowawayCodec(CodecContract):
    """Every contract test, for a codec registered only for this class."""

    def test_the_grammar_and_record_header_know_it(self, codec_name):
        spec = parse_method(f"{codec_name}+topk:k=16")
        assert isinstance(spec.full.codec, FP16) and spec.full.read.k == 16
        q = get_codec(codec_name).encode(torch.ones(2, 8))
        assert q.spec == codec_name and q.dequantize().dtype == torch.float32


def test_unregistered_after_the_class():
    assert FP16.name not in REGISTRY
    with pytest.raises(ValueError, match="unknown method 'fp16test'"):
        parse_method(FP16.name)
