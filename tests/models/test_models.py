"""Built-in models: shapes, loss definitions, causality, checkpointing, sampling, factory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.models import BUILTIN_MODELS, MLPClassifier, TinyGPT, build_builtin_model
from workbench.models.losses import model_kind

from support import tiny_gpt


def small_gpt(**overrides) -> TinyGPT:
    """TinyGPT with two layers, 32 wide, over 50 tokens and 16 positions (seed 0)."""
    return tiny_gpt(0, **{"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_embd": 32, **overrides})


def random_ids(batch: int = 3, seq: int = 12, vocab: int = 50, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- TinyGPT


def test_tiny_gpt_attributes_and_config():
    model = small_gpt()
    assert model.loss_type == "ForCausalLM" and model_kind(model) == "ForCausalLM"
    assert model.main_input_name == "input_ids"
    assert model.supports_gradient_checkpointing is True
    assert model.config == {"vocab_size": 50, "n_layer": 2, "n_head": 2, "n_embd": 32,
                            "block_size": 16, "dropout": 0.0, "tie_weights": True}
    assert model.get_input_embeddings() is model.wte


def test_tiny_gpt_logits_shape_without_labels():
    model = small_gpt()
    out = model(random_ids())
    assert list(out) == ["logits"]
    assert out["logits"].shape == (3, 12, 50)


def test_tiny_gpt_loss_is_shifted_cross_entropy_and_first():
    model = small_gpt()
    ids = random_ids()
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    assert list(out) == ["loss", "logits"]
    logits = out["logits"]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out["loss"], expected)


def test_tiny_gpt_loss_with_num_items_is_sum_over_count():
    model = small_gpt()
    ids = random_ids()
    out = model(ids, labels=ids, num_items_in_batch=100)
    logits = out["logits"]
    summed = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(out["loss"], summed / 100)
    # With the true count it equals the plain mean.
    n_targets = ids[:, 1:].numel()
    torch.testing.assert_close(model(ids, labels=ids, num_items_in_batch=torch.tensor(n_targets))["loss"],
                               model(ids, labels=ids)["loss"])


def test_tiny_gpt_is_causal():
    model = small_gpt().eval()
    ids = random_ids(batch=1)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 50
    a, b = model(ids)["logits"], model(changed)["logits"]
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_tiny_gpt_padding_mask_matches_unpadded_logits():
    model = small_gpt().eval()
    ids = random_ids(batch=1, seq=6)
    reference = model(ids)["logits"]
    pad = torch.zeros(1, 3, dtype=torch.long)
    right = model(torch.cat([ids, pad], 1), attention_mask=torch.cat([torch.ones_like(ids), pad], 1))["logits"]
    left = model(torch.cat([pad, ids], 1), attention_mask=torch.cat([pad, torch.ones_like(ids)], 1))["logits"]
    torch.testing.assert_close(right[:, :6], reference)
    torch.testing.assert_close(left[:, 3:], reference)
    assert torch.isfinite(left).all()
    # An all-ones mask is the same as no mask.
    torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids))["logits"], reference)


def test_tiny_gpt_tied_weights_and_parameter_count():
    tied, untied = small_gpt(), small_gpt(tie_weights=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 50 * 32
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    tied.wpe.weight.requires_grad_(False)
    assert tied.num_parameters(only_trainable=True) == tied.num_parameters() - 16 * 32


def test_tiny_gpt_init_is_gpt2_like():
    model = TinyGPT()
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert all(torch.count_nonzero(m.bias) == 0 for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)


def test_gradient_checkpointing_gives_same_gradients():
    ids = random_ids()
    grads = []
    for enable in (False, True):
        model = small_gpt(dropout=0.1).train()
        if enable:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        torch.manual_seed(123)  # same dropout masks in both runs
        model(ids, labels=ids)["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_gradient_checkpointing_is_used_only_in_training(monkeypatch):
    import workbench.models.tiny_gpt as tiny_gpt_module

    calls = []
    real = tiny_gpt_module.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_gpt_module, "checkpoint", counting)
    model = small_gpt()
    model.gradient_checkpointing_enable({"preserve_rng_state": False})
    ids = random_ids()
    model.train()(ids)
    assert len(calls) == 2 and calls[0] == {"use_reentrant": False, "preserve_rng_state": False}
    model.eval()(ids)
    assert len(calls) == 2
    model.train().gradient_checkpointing_disable()
    model(ids)
    assert len(calls) == 2 and not model.is_gradient_checkpointing


def test_generate_length_and_greedy_determinism():
    model = small_gpt().train()
    prompt = random_ids(batch=2, seq=5)
    out = model.generate(prompt, max_new_tokens=20, temperature=0)
    assert out.shape == (2, 25)  # longer than block_size: the context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=20, temperature=0))
    assert model.training  # mode restored
    # Greedy picks the argmax of the model's own next-token logits.
    assert torch.equal(out[:, 5], model.eval()(prompt)["logits"][:, -1].argmax(-1))


def test_generate_sampling_is_reproducible_with_generator():
    model = small_gpt()
    prompt = random_ids(batch=1, seq=3)
    a = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (1, 13)
    assert model.generate(prompt[0], 4).shape == (7,)  # a 1-D prompt stays 1-D
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_generate_top_k_one_is_greedy():
    model = small_gpt()
    prompt = random_ids(batch=1, seq=3)
    sampled = model.generate(prompt, 8, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, model.generate(prompt, 8, temperature=0))


def test_block_size_overflow_raises():
    model = small_gpt()
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(random_ids(seq=17))
    model(random_ids(seq=16))


def test_tiny_gpt_rejects_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        TinyGPT(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        TinyGPT(n_layer=0)


# ----------------------------------------------------------------------------- MLP


def test_mlp_shapes_and_loss():
    torch.manual_seed(0)
    model = MLPClassifier(in_features=8, hidden=16, num_classes=3, n_layer=2)
    assert model.loss_type == "ForSequenceClassification" and model_kind(model) == "ForSequenceClassification"
    x = torch.randn(5, 8)
    labels = torch.tensor([0, 1, 2, 1, 0])
    assert list(model(x)) == ["logits"]
    out = model(x, labels=labels)
    assert list(out) == ["loss", "logits"]
    assert out["logits"].shape == (5, 3)
    torch.testing.assert_close(out["loss"], F.cross_entropy(out["logits"], labels))
    summed = F.cross_entropy(out["logits"], labels, reduction="sum")
    torch.testing.assert_close(model(x, labels=labels, num_items_in_batch=10)["loss"], summed / 10)


def test_mlp_has_norm_and_bias_parameters():
    model = MLPClassifier()
    names = [n for n, _ in model.named_parameters()]
    assert any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert any(n.endswith("bias") for n in names)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- factory


def test_build_builtin_model():
    assert set(BUILTIN_MODELS) == {"tiny-gpt", "mlp"}
    gpt = build_builtin_model("tiny-gpt", n_layer=1, n_embd=16, n_head=2)
    assert isinstance(gpt, TinyGPT) and len(gpt.blocks) == 1
    assert isinstance(build_builtin_model("mlp", num_classes=7), MLPClassifier)


def test_build_builtin_model_unknown_name():
    with pytest.raises(ValueError) as err:
        build_builtin_model("gpt5")
    assert str(err.value) == "unknown builtin model 'gpt5'; choose one of: mlp, tiny-gpt"


def test_build_builtin_model_bad_option_lists_accepted():
    with pytest.raises(ValueError, match="n_layers") as err:
        build_builtin_model("tiny-gpt", n_layers=3)
    for option in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "tie_weights"):
        assert option in str(err.value)
    assert "self" not in str(err.value)
