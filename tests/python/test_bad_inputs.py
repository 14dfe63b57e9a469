"""Bad inputs: each gets a clear error naming the argument and what it got; never a crash or garbage."""

import pytest
import torch

import fastmha

D, H = 8, 2


def block_call(q=None, k=None, v=None, ws=None, heads=H, mask=None, p=0.0):
    q = torch.randn(2, 3, D) if q is None else q
    k = torch.randn(2, 4, D) if k is None else k
    v = torch.randn(2, 4, D) if v is None else v
    ws = [torch.randn(D, D) for _ in range(4)] if ws is None else ws
    return torch.ops.fastmha.multi_head_attention(q, k, v, *ws, heads, mask, p, True)


def core_call(q=None, k=None, v=None, mask=None, p=0.0):
    q = torch.randn(2, 2, 3, 4) if q is None else q
    k = torch.randn(2, 2, 5, 4) if k is None else k
    v = torch.randn(2, 2, 5, 4) if v is None else v
    return torch.ops.fastmha.attention(q, k, v, mask, p, True)


@pytest.mark.parametrize("d_model,h,dropout,match", [
    (10, 3, 0.0, r"d_model must be divisible by h, got d_model=10 and h=3"),
    (0, 1, 0.0, r"d_model must be a positive int, got 0"),
    (-8, 2, 0.0, r"d_model must be a positive int, got -8"),
    (8, 0, 0.0, r"h must be a positive int, got 0"),
    (8, -2, 0.0, r"h must be a positive int, got -2"),
    (8, True, 0.0, r"h must be a positive int, got True"),
    (8.0, 2, 0.0, r"d_model must be a positive int, got 8.0"),
    (8, 2, 1.5, r"dropout must be a number in \[0, 1\], got 1.5 \(float\)"),
    (8, 2, -0.1, r"dropout must be a number in \[0, 1\], got -0.1 \(float\)"),
    (8, 2, float("nan"), r"dropout must be a number in \[0, 1\], got nan \(float\)"),
    (8, 2, "0.1", r"dropout must be a number in \[0, 1\], got '0.1' \(str\)"),
    (8, 2, None, r"dropout must be a number in \[0, 1\], got None \(NoneType\)"),
    (8, 2, torch.tensor([0.1, 0.2]), r"dropout must be a number in \[0, 1\], got tensor\(\[0.1000, 0.2000\]\) \(Tensor\)"),
])
def test_module_constructor_errors(d_model, h, dropout, match):
    with pytest.raises(ValueError, match=match):
        fastmha.MultiHeadAttentionBlock(d_model, h, dropout)


BLOCK_CASES = {
    "query not 3-D": (dict(q=torch.randn(2, 3, 4, D)), r"query must be 3-D \(batch, Lq, d_model\), got shape \[2, 3, 4, 8\]"),
    "key not 3-D": (dict(k=torch.randn(4, D)), r"key must be 3-D .* got shape \[4, 8\]"),
    "query last dim": (dict(q=torch.randn(2, 3, 6)), r"query must have d_model = 8 features \(last dim\), got shape \[2, 3, 6\]"),
    "value last dim": (dict(v=torch.randn(2, 4, 9)), r"value must have d_model = 8 .* got shape \[2, 4, 9\]"),
    "batch mismatch": (dict(k=torch.randn(3, 4, D), v=torch.randn(3, 4, D)), r"same batch size .* query \[2, 3, 8\], key \[3, 4, 8\]"),
    "key/value length": (dict(v=torch.randn(2, 5, D)), r"key and value must have the same length \(dim 1\), got key \[2, 4, 8\], value \[2, 5, 8\]"),
    "weight shape": (dict(ws=[torch.randn(D, D), torch.randn(D, 4), torch.randn(D, D), torch.randn(D, D)]), r"w_k must have w_q's shape \(d_model, d_model\) = \(8, 8\), got \[8, 4\]"),
    # w_q gives d_model: the errors say so.
    "w_q not square": (dict(ws=[torch.randn(4, D)] + [torch.randn(D, D)] * 3), r"w_q must be square \(d_model, d_model\), got \[4, 8\]"),
    "weights of another d_model": (dict(ws=[torch.randn(4, 4)] * 4), r"query must have d_model = 4 features \(last dim\), got shape \[2, 3, 8\]; d_model is w_q's size \[4, 4\]"),
    "weight rank": (dict(ws=[torch.randn(D)] + [torch.randn(D, D)] * 3), r"w_q must be 2-D \(d_model, d_model\), got shape \[8\]"),
    "heads do not divide": (dict(heads=3), r"d_model must be divisible by num_heads, got d_model 8 and num_heads 3"),
    "heads zero": (dict(heads=0), r"num_heads must be positive, got 0"),
    "dropout 1": (dict(p=1.0), r"dropout_p must be in \[0, 1\), got 1"),
    "dropout negative": (dict(p=-0.5), r"dropout_p must be in \[0, 1\), got -0.5"),
    "dropout nan": (dict(p=float("nan")), r"dropout_p must be in \[0, 1\), got nan"),
    "integer inputs": (dict(q=torch.ones(2, 3, D, dtype=torch.long)), r"query must be a floating-point tensor .* got Long"),
    "dtype mismatch": (dict(k=torch.randn(2, 4, D, dtype=torch.float64)), r"key must have the query's dtype Float, got Double"),
    "weight dtype": (dict(ws=[torch.randn(D, D, dtype=torch.float64)] + [torch.randn(D, D)] * 3), r"w_q must have the query's dtype Float, got Double"),
    "mask not broadcastable": (dict(mask=torch.ones(2, 1, 3, 5)), r"mask of shape \[2, 1, 3, 5\] does not broadcast to the scores \(batch, h, Lq, Lk\) \[2, 2, 3, 4\]"),
    "mask too many dims": (dict(mask=torch.ones(1, 2, 1, 3, 4)), r"mask must have at most 4 dims .* got shape \[1, 2, 1, 3, 4\]"),
    "mask would grow the scores": (dict(mask=torch.ones(4, 2, 3, 4)), r"does not broadcast"),
    "complex mask": (dict(mask=torch.ones(4, dtype=torch.complex64)), r"mask must be a real or bool tensor, got ComplexFloat"),
    "(batch, Lk) padding mask": (dict(mask=torch.ones(2, 4)), r"does not broadcast .* a \(batch, Lk\) padding mask needs the head and query dims: mask\[:, None, None, :\]"),
    "sparse query": (dict(q=torch.randn(2, 3, D).to_sparse()), r"query must be a dense \(strided\) tensor, got layout Sparse"),
    "sparse weight": (dict(ws=[torch.randn(D, D)] * 3 + [torch.randn(D, D).to_sparse()]), r"w_o must be a dense \(strided\) tensor"),
    "sparse mask": (dict(mask=torch.ones(2, 1, 1, 4).to_sparse()), r"mask must be a dense \(strided\) tensor, got layout Sparse"),
}


@pytest.mark.parametrize("kwargs,match", list(BLOCK_CASES.values()), ids=list(BLOCK_CASES))
def test_block_op_errors(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        block_call(**kwargs)


CORE_CASES = {
    "query not 4-D": (dict(q=torch.randn(2, 3, 4)), r"query must be 4-D \(batch, h, Lq, d_k\), got shape \[2, 3, 4\]"),
    "d_k mismatch": (dict(k=torch.randn(2, 2, 5, 3)), r"key must have the query's head size d_k \(dim 3\)"),
    "heads mismatch": (dict(k=torch.randn(2, 3, 5, 4), v=torch.randn(2, 3, 5, 4)), r"same number of heads"),
    "key/value length": (dict(v=torch.randn(2, 2, 6, 4)), r"key and value must have the same length \(dim 2\)"),
    "zero head size": (dict(q=torch.randn(2, 2, 3, 0), k=torch.randn(2, 2, 5, 0)), r"head size d_k .* must be positive"),
    "half mask mismatch": (dict(mask=torch.ones(3, 4)), r"mask of shape \[3, 4\] does not broadcast .* \[2, 2, 3, 5\]"),
    "bool inputs": (dict(q=torch.ones(2, 2, 3, 4, dtype=torch.bool)), r"floating-point tensor .* got Bool"),
    "sparse key": (dict(k=torch.randn(2, 2, 5, 4).to_sparse()), r"key must be a dense \(strided\) tensor, got layout Sparse"),
    "sparse mask": (dict(mask=torch.ones(3, 5).to_sparse()), r"mask must be a dense \(strided\) tensor, got layout Sparse"),
}


@pytest.mark.parametrize("kwargs,match", list(CORE_CASES.values()), ids=list(CORE_CASES))
def test_core_op_errors(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        core_call(**kwargs)


NONE_CASES = [("query", lambda x, w: (None, x, x, *w)), ("key", lambda x, w: (x, None, x, *w)),
              ("value", lambda x, w: (x, x, None, *w)), ("w_q", lambda x, w: (x, x, x, None, *w[1:])),
              ("w_o", lambda x, w: (x, x, x, *w[:3], None))]


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference", "autocast"])
@pytest.mark.parametrize("name,make", NONE_CASES, ids=[name for name, _ in NONE_CASES])
def test_none_for_a_tensor_is_named(mode, name, make):
    # None reaches the ops as an undefined tensor: the first kernel (autograd, autocast or composite) names it.
    x = torch.randn(2, 3, D, requires_grad=True)
    ws = [torch.randn(D, D, requires_grad=True) for _ in range(4)]
    heads = torch.randn(2, H, 3, D // H)
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode,
                "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    with contexts[mode](), pytest.raises(RuntimeError, match=name + r" must be a tensor, got None"):
        torch.ops.fastmha.multi_head_attention(*make(x, ws), H)
    if name in ("query", "key", "value"):
        core = make(heads, [])
        with contexts[mode](), pytest.raises(RuntimeError, match=name + r" must be a tensor, got None"):
            torch.ops.fastmha.attention(*core)
        with contexts[mode](), pytest.raises(RuntimeError, match=name + r" must be a tensor, got None"):
            fastmha.MultiHeadAttentionBlock.attention(*core, None, None)
        with contexts[mode](), pytest.raises(RuntimeError, match=name + r" must be a tensor, got None"):
            fastmha.MultiHeadAttentionBlock(D, H, 0.0)(*make(x, []))


def test_module_forward_errors_name_the_argument():
    block = fastmha.MultiHeadAttentionBlock(D, H, 0.0)
    with pytest.raises(RuntimeError, match=r"query must be 3-D"):
        block(torch.randn(3, D), torch.randn(3, D), torch.randn(3, D), None)
    with pytest.raises(RuntimeError, match=r"w_q must have the query's dtype Double, got Float"):
        x = torch.randn(1, 2, D, dtype=torch.float64)
        block(x, x, x, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_errors():
    with pytest.raises(RuntimeError, match=r"key must be on the query's device cpu, got cuda"):
        core_call(k=torch.randn(2, 2, 5, 4, device="cuda"))
    with pytest.raises(RuntimeError, match=r"mask must be on the query's device cpu, got cuda"):
        core_call(mask=torch.ones(5, device="cuda"))


def test_device_mismatch_with_meta_tensors():
    # Meta stands in for a second device on machines without a GPU: the check is the same.
    with pytest.raises(RuntimeError, match=r"key must be on the query's device cpu, got meta"):
        core_call(k=torch.randn(2, 2, 5, 4, device="meta"))
    with pytest.raises(RuntimeError, match=r"mask must be on the query's device cpu, got meta"):
        core_call(mask=torch.ones(5, device="meta"))


def test_empty_batch_and_zero_length_through_the_module():
    block = fastmha.MultiHeadAttentionBlock(D, H, 0.1)
    for q_shape, kv_shape in [((0, 3, D), (0, 4, D)), ((2, 0, D), (2, 4, D)), ((2, 3, D), (2, 0, D))]:
        q, kv = torch.randn(q_shape), torch.randn(kv_shape)
        out = block(q, kv, kv, None)
        assert out.shape == q_shape
        assert block.attention_scores.shape == (q_shape[0], H, q_shape[1], kv_shape[1])
        assert torch.isfinite(out).all()


def step_call(x=None, cache=None, mask=None):
    x = torch.randn(2, 3, D) if x is None else x
    ws = [torch.randn(D, D) for _ in range(4)]
    cache = (torch.randn(2, H, 4, D // H),) * 2 if cache is None else cache
    return torch.ops.fastmha.multi_head_attention_step(x, *ws, H, *cache, mask)


STEP_CASES = {
    "integer cache": (dict(cache=(torch.ones(2, H, 4, D // H, dtype=torch.long),) * 2), r"key_cache must have the projected keys' dtype Float and device cpu, got Long"),
    "float64 value cache": (dict(cache=(torch.randn(2, H, 4, D // H), torch.randn(2, H, 4, D // H, dtype=torch.float64))), r"value_cache must have the projected keys' dtype Float .* got Double"),
    "meta cache": (dict(cache=(torch.randn(2, H, 4, D // H, device="meta"),) * 2), r"key_cache must have the projected keys' dtype Float and device cpu, got Float on meta"),
    "complex mask": (dict(mask=torch.ones(7, dtype=torch.complex64)), r"mask must be a real or bool tensor, got ComplexFloat"),
    # The caller's mask is checked as given: 7 keys (4 cached + 3 new), not the 5 it holds.
    "mask length": (dict(mask=torch.ones(2, 1, 1, 5)), r"mask of shape \[2, 1, 1, 5\] does not broadcast to the scores \(batch, h, Lq, Lk\) \[2, 2, 3, 7\]"),
    "mask batch": (dict(mask=torch.ones(3, 1, 1, 7)), r"mask of shape \[3, 1, 1, 7\] does not broadcast"),
    "sparse x": (dict(x=torch.randn(2, 3, D).to_sparse()), r"x must be a dense \(strided\) tensor, got layout Sparse"),
    # The step's input is x: its errors say so.
    "integer x": (dict(x=torch.ones(2, 3, D, dtype=torch.long)), r"x must be a floating-point tensor .*, got Long"),
    "x features": (dict(x=torch.randn(2, 3, D - 1)), r"x must have d_model = 8 features \(last dim\), got shape \[2, 3, 7\]"),
    "2-D x": (dict(x=torch.randn(3, D)), r"x must be 3-D \(batch, Lq, d_model\), got shape \[3, 8\]"),
    "float64 x": (dict(x=torch.randn(2, 3, D, dtype=torch.float64)), r"w_q must have the x's dtype Double, got Float"),
    "meta mask": (dict(mask=torch.ones(7, device="meta")), r"mask must be on the x's device cpu, got meta"),
}


@pytest.mark.parametrize("kwargs,match", list(STEP_CASES.values()), ids=list(STEP_CASES))
def test_step_op_errors(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        step_call(**kwargs)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_inputs_are_named():
    nested = torch.nested.nested_tensor([torch.randn(2, 3, 4), torch.randn(2, 5, 4)])
    q, k = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4)
    with pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor, got a nested tensor"):
        torch.ops.fastmha.attention(nested, k, k, None, 0.0, True)
    with pytest.raises(RuntimeError, match=r"mask must be a dense \(strided\) tensor, got a nested tensor"):
        torch.ops.fastmha.attention(q, k, k, torch.nested.nested_tensor([torch.ones(3, 5), torch.ones(3, 5)]), 0.0,
                                    True)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("reuse_projections", [True, False])
def test_nested_query_of_the_block_is_named_without_grad(reuse_projections):
    # Without grad the block looks for kept key and value projections first; a nested query still gets the op's error.
    block = fastmha.MultiHeadAttentionBlock(4, 2, 0.0, reuse_projections=reuse_projections)
    nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)])
    memory = torch.randn(2, 6, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor, got a nested"):
        block(nested, memory, memory)


# Inference mode skips the autograd kernels, which ask the layout first elsewhere: each op must still name it.
LAYOUT_CASES = {f"{op} {name}": (call, *cases[name]) for op, call, cases in [
    ("block", block_call, BLOCK_CASES), ("core", core_call, CORE_CASES), ("step", step_call, STEP_CASES)]
    for name in cases if name.startswith("sparse")}


@pytest.mark.parametrize("call,kwargs,match", list(LAYOUT_CASES.values()), ids=list(LAYOUT_CASES))
def test_layout_errors_in_inference_mode(call, kwargs, match):
    with torch.inference_mode(), pytest.raises(RuntimeError, match=match):
        call(**kwargs)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_inputs_in_inference_mode_are_named():
    with torch.inference_mode():
        nested = torch.nested.nested_tensor([torch.randn(2, 3, 4), torch.randn(2, 5, 4)])
        k = torch.randn(2, 2, 5, 4)
        with pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor, got a nested tensor"):
            torch.ops.fastmha.attention(nested, k, k, None, 0.0, True)
        x, ws = torch.randn(2, 3, D), [torch.randn(D, D) for _ in range(4)]
        nested_mask = torch.nested.nested_tensor([torch.ones(3, 3), torch.ones(3, 3)])
        with pytest.raises(RuntimeError, match=r"mask must be a dense \(strided\) tensor, got a nested tensor"):
            torch.ops.fastmha.multi_head_attention(x, x, x, *ws, H, nested_mask)
        nested_x = torch.nested.nested_tensor([torch.randn(3, D), torch.randn(5, D)])
        with pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor, got a nested tensor"):
            torch.ops.fastmha.multi_head_attention(nested_x, x, x, *ws, H)
        with pytest.raises(RuntimeError, match=r"x must be a dense \(strided\) tensor, got a nested tensor"):
            torch.ops.fastmha.multi_head_attention_step(nested_x, *ws, H, None, None, None, 0.0)


def backward_call(**changes):
    """The private backward op on one forward's saved tensors, with some of them replaced."""
    q, k, v = (torch.randn(2, 3, 6, 4) for _ in range(3))
    out, _, lse, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, 0.5, False, False)
    saved = dict(grad_output=torch.randn_like(out), grad_weights=None, output=out, logsumexp=lse, rng_state=rng_state)
    saved.update(changes)
    return torch.ops.fastmha._attention_backward(saved["grad_output"], saved["grad_weights"], q, k, v, None, saved["output"],
                                                 saved["logsumexp"], saved["rng_state"], 0.5, False)


BACKWARD_CASES = {
    "empty logsumexp": (dict(logsumexp=torch.empty(0)), r"logsumexp must be the forward's \(batch, h, Lq\) = \[2, 3, 6\] Float on cpu, got \[0\]"),
    "short logsumexp": (dict(logsumexp=torch.zeros(2, 3, 1)), r"logsumexp must be the forward's .* got \[2, 3, 1\]"),
    "empty rng_state": (dict(rng_state=torch.empty(0, dtype=torch.long)), r"rng_state must be the forward's 2 int64 values \(seed, offset\), got \[0\] Long"),
    "small grad_output": (dict(grad_output=torch.randn(1, 1, 1, 1)), r"grad_output must have the forward output's shape \(batch, h, Lq, d_v\) = \[2, 3, 6, 4\], got \[1, 1, 1, 1\]"),
    "output dtype": (dict(output=torch.randn(2, 3, 6, 4, dtype=torch.float64)), r"output must have the query's dtype Float, got Double"),
    # A gradient of the weights smaller than them would be read past its end.
    "one-element grad_weights": (dict(grad_weights=torch.randn(1, 1, 1, 1)), r"grad_weights must have the weights' shape \(batch, h, Lq, Lk\) = \(2, 3, 6, 6\), got shape \[1, 1, 1, 1\]"),
    "grad_weights of one key": (dict(grad_weights=torch.randn(2, 3, 6, 1)), r"grad_weights must have the weights' shape .* got shape \[2, 3, 6, 1\]"),
    "2-D grad_weights": (dict(grad_weights=torch.randn(6, 6)), r"grad_weights must have the weights' shape .* got shape \[6, 6\]"),
    "grad_weights dtype": (dict(grad_weights=torch.randn(2, 3, 6, 6, dtype=torch.float64)), r"grad_weights must have the query's dtype Float, got Double"),
}


@pytest.mark.parametrize("changes,match", list(BACKWARD_CASES.values()), ids=list(BACKWARD_CASES))
def test_private_backward_checks_the_forwards_tensors(changes, match):
    # Autograd always passes consistent tensors; a direct call with others gets an error, not a crash.
    with pytest.raises(RuntimeError, match=match):
        backward_call(**changes)
    backward_call()  # the consistent call runs


def test_private_backward_checks_grad_weights_on_meta_tensors():
    # The shapes a traced graph sees are checked alike.
    q, k, v = (torch.randn(2, 3, 6, 4, device="meta") for _ in range(3))
    out, weights, lse, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, 0.0, True, False)
    with pytest.raises(RuntimeError, match=r"grad_weights must have the weights' shape .* got shape \[2, 3, 6, 1\]"):
        torch.ops.fastmha._attention_backward(torch.randn_like(out), torch.randn(2, 3, 6, 1, device="meta"), q, k, v,
                                              None, out, lse, rng_state, 0.0, False)
    grads = torch.ops.fastmha._attention_backward(torch.randn_like(out), torch.randn_like(weights), q, k, v, None, out,
                                                  lse, rng_state, 0.0, False)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def block_backward_call(heads=H, **changes):
    """The block's private backward op on one forward's saved tensors, with some of them replaced."""
    q, k, v = torch.randn(2, 3, D), torch.randn(2, 5, D), torch.randn(2, 5, D)
    ws = [torch.randn(D, D) for _ in range(4)]
    out, weights, q_proj, k_proj, v_proj, context, lse, rng_state = torch.ops.fastmha._multi_head_attention_forward(
        q, k, v, *ws, H, None, 0.0, True, False)
    saved = dict(grad_output=torch.randn_like(out), grad_weights=torch.randn_like(weights), query_proj=q_proj,
                 key_proj=k_proj, value_proj=v_proj, context=context, grad_query_proj=None, grad_key_proj=None,
                 grad_value_proj=None)
    saved.update(changes)
    return torch.ops.fastmha._multi_head_attention_backward(
        saved["grad_output"], saved["grad_weights"], q, k, v, *ws, saved["query_proj"], saved["key_proj"],
        saved["value_proj"], saved["context"], lse, rng_state, heads, None, 0.0, False, None, saved["grad_query_proj"],
        saved["grad_key_proj"], saved["grad_value_proj"])


BLOCK_BACKWARD_CASES = {
    "no heads": (dict(heads=0), r"num_heads must be positive, got 0"),
    "heads do not divide": (dict(heads=3), r"d_model must be divisible by num_heads, got d_model 8 and num_heads 3"),
    "other heads": (dict(heads=4), r"logsumexp must be the forward's \(batch, h, Lq\) = \[2, 4, 3\]"),
    "small grad_output": (dict(grad_output=torch.randn(2, 1, D)), r"grad_output must have shape \(batch, Lq, d_model\) = \[2, 3, 8\], got \[2, 1, 8\]"),
    "grad_weights": (dict(grad_weights=torch.randn(1, 1, 1, 1)), r"grad_weights must have the weights' shape \(batch, h, Lq, Lk\) = \(2, 2, 3, 5\)"),
    "query_proj": (dict(query_proj=torch.randn(2, 5, D)), r"query_proj must have shape \(batch, Lq, d_model\) = \[2, 3, 8\], got \[2, 5, 8\]"),
    "key_proj dtype": (dict(key_proj=torch.randn(2, 5, D, dtype=torch.float64)), r"key_proj must have the query's dtype Float, got Double"),
    "context": (dict(context=torch.randn(2, 3, 4)), r"context must have shape \(batch, Lq, d_model\) = \[2, 3, 8\], got \[2, 3, 4\]"),
    # Another path's gradient of a projection is added to the attention's: one that broadcasts is an error.
    "broadcast grad_key_proj": (dict(grad_key_proj=torch.randn(1, 1, D)), r"grad_key_proj must have shape \(batch, Lk, d_model\) = \[2, 5, 8\], got \[1, 1, 8\]"),
    "1-D grad_value_proj": (dict(grad_value_proj=torch.randn(D)), r"grad_value_proj must have shape \(batch, Lk, d_model\) = \[2, 5, 8\], got \[8\]"),
    "grad_query_proj rows": (dict(grad_query_proj=torch.randn(2, 5, D)), r"grad_query_proj must have shape \(batch, Lq, d_model\) = \[2, 3, 8\], got \[2, 5, 8\]"),
}


@pytest.mark.parametrize("changes,match", list(BLOCK_BACKWARD_CASES.values()), ids=list(BLOCK_BACKWARD_CASES))
def test_private_block_backward_checks_the_forwards_tensors(changes, match):
    # Autograd always passes consistent tensors; a direct call with others gets an error, not a crash.
    with pytest.raises(RuntimeError, match=match):
        block_backward_call(**changes)
    grads = block_backward_call(grad_query_proj=torch.randn(2, 3, D), grad_key_proj=torch.randn(2, 5, D))
    assert [tuple(g.shape) for g in grads] == [(2, 3, D), (2, 5, D), (2, 5, D)] + [(D, D)] * 4


@pytest.mark.parametrize("content,match", [
    (torch.ones(2), r"holds no state dict \(a dict of str to Tensor\), got Tensor"),
    ({"w_q.weight": torch.ones(2), "step": 3}, r"holds no state dict .* got a dict with entry 'step': int"),
    ({0: torch.ones(2)}, r"holds no state dict .* got a dict with entry 0: Tensor"),
], ids=["tensor", "int value", "int key"])
def test_cpp_state_dict_loader_names_a_file_without_one(tmp_path, content, match):
    path = tmp_path / "saved.pt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=match):
        fastmha.load_cpp_state_dict(path)
