"""ONNX export of a model holding the block (both torch exporters): the block computes with torch's own ops while
exporting, so the graph has standard operators only; onnxruntime runs it against the oracle block."""

import warnings

import pytest
import torch
from oracle import OracleBlock

import fastmha

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

D_MODEL, HEADS = 16, 4


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dynamo", [False, True])
def test_exported_block_runs_in_onnxruntime(tmp_path, dynamo, is_causal):
    if dynamo:
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.1, is_causal=is_causal).eval()
    oracle = OracleBlock(D_MODEL, HEADS).eval()
    oracle.load_state_dict(block.state_dict())
    q, kv = torch.randn(2, 5, D_MODEL), torch.randn(2, 5, D_MODEL)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.int64)
    mask[1, ..., 2:] = 0
    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(block, (q, kv, kv, mask), dynamo=True).save(str(path))
        else:
            torch.onnx.export(block, (q, kv, kv, mask), str(path), dynamo=False)
    model = onnx.load(str(path))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}  # standard operators only
    session = ort.InferenceSession(str(path))
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), (q, kv, kv, mask))}
    got = torch.from_numpy(session.run(None, feeds)[0])
    oracle_mask = mask * torch.ones(5, 5, dtype=torch.int64).tril() if is_causal else mask
    torch.testing.assert_close(got, oracle(q, kv, kv, oracle_mask)[0].detach(), atol=1e-5, rtol=1e-4)
