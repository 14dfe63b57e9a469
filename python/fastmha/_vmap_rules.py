"""vmap rules for the ops that may draw dropout.

Without a rule, vmap runs an op slice by slice and ignores its ``randomness`` argument. These rules run the op
slice by slice too, and honour ``randomness`` as torch's own random ops do: ``"error"`` (vmap's default) raises for
a call with dropout, ``"same"`` gives every slice the mask of the first (each slice starts from the same generator
state, left where one call leaves it), ``"different"`` draws a mask per slice. They apply where a tensor input is
batched; a call whose inputs are all unbatched runs once, as outside vmap.
"""

import torch

# The ops with a dropout_p argument.
RANDOM_OPS = ("attention", "multi_head_attention", "multi_head_attention_step", "_attention_forward",
              "_multi_head_attention_forward")


def _generator_state(device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device), lambda state: torch.cuda.set_rng_state(state, device)
    return torch.get_rng_state(), torch.set_rng_state


def _slice_by_slice(op):
    names = [argument.name for argument in op._schema.arguments]

    def rule(info, in_dims, *args, **kwargs):
        values = dict(zip(names, args), **kwargs)
        dropout_p = values.get("dropout_p", 0.0)
        if dropout_p > 0 and info.randomness == "error":
            raise RuntimeError(
                f"vmap: called random operation while in randomness error mode: {op} with dropout_p={dropout_p}. "
                "Pass randomness='same' or 'different' to vmap, or call it outside vmap")
        if info.batch_size == 0:  # no slice to take the outputs' shapes from
            raise RuntimeError(f"vmap: {op} does not support vmap over a dimension of size 0")
        restore = None
        if dropout_p > 0 and info.randomness == "same":
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            state, set_state = _generator_state(device)
            restore = lambda: set_state(state)  # noqa: E731
        results = []
        for i in range(info.batch_size):
            if restore is not None:
                restore()
            sliced = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
            results.append(op(*sliced, **kwargs))
        outputs = tuple(torch.stack(parts) for parts in zip(*results))
        return outputs, (0,) * len(outputs)

    return rule


def register():
    for name in RANDOM_OPS:
        torch.library.register_vmap(f"fastmha::{name}", _slice_by_slice(getattr(torch.ops.fastmha, name).default))
