"""Client-side routed experts (R3): decoding the engines' payloads and pairing each routing row
with the version that produced it (stitch_core.serve.protocol; docs/rl.md "Routing replay")."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from stitch_core.serve import protocol
from stitch_core.serve.protocol import RoutedExpertsError


def _sglang(arr: np.ndarray) -> str:  # detokenizer_manager: base64 of the raw int32 bytes
    return base64.b64encode(arr.astype(np.int32).tobytes()).decode()


def _vllm(arr: np.ndarray) -> str:  # vLLM: base64 of np.save bytes
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_decodes_sglang_raw_int32_with_its_shape():
    arr = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3)
    got = protocol.decode_routed_experts(_sglang(arr), layers=2, top_k=3)
    assert got.shape == (5, 2, 3) and np.array_equal(got, arr)
    with pytest.raises(RoutedExpertsError, match="needs layers and top_k"):
        protocol.decode_routed_experts(_sglang(arr))
    with pytest.raises(RoutedExpertsError, match="no whole rows"):
        protocol.decode_routed_experts(_sglang(arr), layers=4, top_k=4)
    with pytest.raises(RoutedExpertsError, match="not base64"):
        protocol.decode_routed_experts("%%%", layers=2, top_k=3)


def test_decodes_vllm_npy_bytes_and_checks_the_shape_when_given():
    arr = np.arange(4 * 3 * 2, dtype=np.int16).reshape(4, 3, 2)
    got = protocol.decode_routed_experts(_vllm(arr))
    assert got.dtype == np.int16 and np.array_equal(got, arr)
    assert np.array_equal(protocol.decode_routed_experts(_vllm(arr), layers=3, top_k=2), arr)
    with pytest.raises(RoutedExpertsError, match="shape"):
        protocol.decode_routed_experts(_vllm(arr), layers=2)
    with pytest.raises(RoutedExpertsError, match="shape"):
        protocol.decode_routed_experts(_vllm(arr[0]))


def test_each_row_belongs_to_the_token_its_forward_sampled():
    # prompt of 4 tokens, 6 output tokens: v3 sampled tokens 0..2, v4 tokens 3..5
    spans = [[3, 0, 2], [4, 3, 5]]
    rows = 4 + 6 - 1  # positions 0..8: the last token is never forwarded
    # the forward of position p >= 3 samples token p - 3 (the prefill, positions 0..3, samples
    # token 0), so position p's row belongs to token max(0, p - 3)
    assert [protocol.routing_row_token(p, 4) for p in range(rows)] == [0, 0, 0, 0, 1, 2, 3, 4, 5]
    versions = protocol.routing_versions(spans, 4, rows)
    assert versions == [3, 3, 3, 3, 3, 3, 4, 4, 4]
    assert protocol.routing_spans(spans, 4) == [(3, 0, 5), (4, 6, 8)]
    # rows from a start position (SGLang's routed_experts_start_len, vLLM's prompt start)
    assert protocol.routing_versions(spans, 4, rows - 5, first_position=5) == [3, 4, 4, 4]
    assert protocol.routing_spans(spans, 4, first_position=5) == [(3, 0, 0), (4, 1, 3)]
    assert protocol.routing_spans(spans, 4, first_position=6) == [(4, 0, 2)]
    # a span of one token at the start owns the whole prompt
    assert protocol.routing_spans([[0, 0, 0], [1, 1, 2]], 2) == [(0, 0, 1), (1, 2, 3)]


def test_rows_beyond_the_spans_or_bad_spans_are_refused():
    with pytest.raises(RoutedExpertsError, match="spans cover 2 tokens"):
        protocol.routing_versions([[0, 0, 1]], 3, 5)  # 3 + 2 - 1 = 4 rows at most
    assert protocol.routing_versions([[0, 0, 1]], 3, 4) == [0] * 4
    with pytest.raises(ValueError):
        protocol.routing_spans([[1, 0, 2], [0, 3, 4]], 3)  # versions must ascend
    with pytest.raises(RoutedExpertsError):
        protocol.routing_row_token(0, 0)


def test_pairs_with_a_parsed_stitch_field():
    body = {"stitch": {"run": "r", "version_start": 1, "version_end": 2,
                       "version_spans": [[1, 0, 1], [2, 2, 2]]},
            "meta_info": {"routed_experts": _sglang(np.zeros((4, 1, 2)))}}
    info = protocol.parse_stitch(body)
    rows = protocol.decode_routed_experts(body["meta_info"]["routed_experts"], 1, 2)
    assert protocol.routing_versions(info.version_spans, 2, rows.shape[0]) == [1, 1, 1, 2]
