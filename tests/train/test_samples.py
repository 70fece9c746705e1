"""Samples as a run trains (workbench/train/samples.py, generation.py): answers to fixed
prompts at each evaluation or every N steps, taken without changing the run.

The runs are real: TinyGPT on the standard library's source (character tokens) where the
chat template does not matter, and the fine-tuning workspace's tiny Llama (a transformers
causal LM with a BPE tokenizer and a chat template) where it does: transformers' generate,
its warnings, its sampling from the global random stream.
"""

from __future__ import annotations


import pytest

from workbench import SamplesCallback
from workbench.core.args.training import ArgumentError
from workbench.core.callbacks import _implements
from workbench.train.generation import encode_prompt, eval_mode, generate_text
from workbench.train.samples import MAX_NEW_TOKENS, MAX_PROMPTS

from support import assert_same_weights, make_trainer, weights
from support.lm import TOK, lm_model, lm_trainer
from support.sampling import PROMPTS, llama_trainer, losses, no_generation_warnings, sample_records

LM_PROMPTS = ["def ", "import os\n"]


def _lm_run(out, callbacks=(), **overrides):
    trainer = lm_trainer(out, callbacks=list(callbacks), dropout=0.1, eval_strategy="steps", eval_steps=10,
                         eval_on_start=True, **overrides)
    trainer.train()
    return trainer


def test_samples_at_each_evaluation_leave_the_run_bitwise_as_without(tmp_path):
    """TinyGPT with dropout (every step draws from the global stream), sampled greedily and
    with a temperature at each of its five evaluations: the weights and every loss are
    bitwise those of the same run without samples, and each evaluation step has one
    non-empty answer per prompt, in events.jsonl as in the callback's history."""
    plain = _lm_run(tmp_path / "plain")
    greedy = SamplesCallback(prompts=LM_PROMPTS, max_new_tokens=12)
    sampled = SamplesCallback(prompts=["class "], max_new_tokens=12, temperature=1.0, top_k=20, seed=3)
    sampling = _lm_run(tmp_path / "sampling", callbacks=[greedy, sampled])
    assert_same_weights(sampling.model, plain.model)
    assert losses(sampling) == losses(plain) and len(losses(plain)) == 8 + 5
    evaluated = [row["step"] for row in plain.state.log_history if "eval_loss" in row]
    assert evaluated == [0, 10, 20, 30, 40]
    assert [(s["step"], s["prompt"]) for s in greedy.history] == [(step, p) for step in evaluated for p in LM_PROMPTS]
    for sample in [*greedy.history, *sampled.history]:
        assert sample["answer"] and sample["tokens"] == 12  # TinyGPT has no end token: all 12 come
    records = sample_records(tmp_path / "sampling")
    assert [(r["step"], r["prompt"], r["answer"], r["tokens"]) for r in records if r["prompt"] != "class "] == [
        (s["step"], s["prompt"], s["answer"], s["tokens"]) for s in greedy.history]
    # Greedy answers are a function of the weights: the final step's, again from the plain run's weights.
    for prompt, answer in [(s["prompt"], s["answer"]) for s in greedy.history if s["step"] == 40]:
        assert generate_text(plain.model, TOK, prompt, max_new_tokens=12).answer == answer


def test_sampling_from_transformers_draws_nothing_the_run_would_draw(tmp_path, finetune_workspace):
    """transformers' generate samples from the global torch stream, which the callback seeds:
    a tiny Llama with attention dropout, sampled with a temperature at each evaluation,
    still trains bitwise as without samples (the streams are put back); and a greedy
    callback's answers are the same in two runs."""
    plain = llama_trainer(finetune_workspace, tmp_path / "plain")
    plain.train()
    hot = SamplesCallback(prompts=PROMPTS, max_new_tokens=6, temperature=0.9, seed=1)
    greedy = SamplesCallback(prompts=PROMPTS, max_new_tokens=6)
    sampling = llama_trainer(finetune_workspace, tmp_path / "sampling", callbacks=[hot, greedy])
    sampling.train()
    assert_same_weights(sampling.model, plain.model)
    assert losses(sampling) == losses(plain)
    assert sorted({s["step"] for s in hot.history}) == [0, 4, 8, 12]
    again = SamplesCallback(prompts=PROMPTS, max_new_tokens=6)
    llama_trainer(finetune_workspace, tmp_path / "again", callbacks=[again]).train()
    assert list(again.history) == list(greedy.history)
    assert all(1 <= s["tokens"] <= 6 for s in greedy.history)


def test_greedy_samples_with_a_checkpoints_generation_defaults_raise_no_transformers_warning(tmp_path,
                                                                                             finetune_workspace):
    """A checkpoint's generation_config.json often sets temperature and top_p; transformers
    warns when those meet greedy decoding ("generation flags are not valid") and when no pad
    token is set. The samples pass a complete GenerationConfig: not one warning, while a
    plain greedy generate on the same model does warn (so the capture would see one)."""
    trainer = llama_trainer(finetune_workspace, tmp_path / "run", max_steps=4,
                            generation_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
                            callbacks=[SamplesCallback(prompts=PROMPTS, max_new_tokens=4)])
    with no_generation_warnings(trainer, PROMPTS[0]):
        trainer.train()
    assert len(trainer.callback_handler.callbacks[-1].history) == 2 * 2  # steps 0 and 4, two prompts


def test_a_chat_tokenizers_prompts_are_asked_as_a_user_message(finetune_workspace):
    """chat (auto): with a chat template each prompt goes in as a user message with the
    assistant's turn opened; chat = false sends the text as it is."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(finetune_workspace.model)
    chat = tok.decode(encode_prompt(tok, PROMPTS[0], chat=True))
    assert chat == f"<s><|user|>{PROMPTS[0]}<|end|><|assistant|>"
    assert tok.decode(encode_prompt(tok, PROMPTS[0], chat=False)) == PROMPTS[0]
    with pytest.raises(ValueError, match="chat_template"):
        encode_prompt(TOK, "def ", chat=True)


def test_every_n_steps_samples_at_those_steps_only_and_costs_no_hook_otherwise(tmp_path):
    """every = 15 over 40 steps without evaluations: samples at steps 15 and 30. The callback
    of every = "eval" has no per-step hook the handler would call."""
    by_steps = SamplesCallback(prompts=["def "], max_new_tokens=4, every=15)
    lm_trainer(tmp_path / "run", callbacks=[by_steps]).train()
    assert [s["step"] for s in by_steps.history] == [15, 30]
    assert [r["step"] for r in sample_records(tmp_path / "run")] == [15, 30]
    at_evals = SamplesCallback(prompts=["def "])
    assert not _implements(at_evals, "on_step_end") and _implements(at_evals, "on_evaluate")
    assert _implements(by_steps, "on_step_end") and not _implements(by_steps, "on_evaluate")


@pytest.mark.parametrize("options, key", [
    ({"prompts": []}, "prompts"),
    ({"prompts": "def "}, "prompts"),
    ({"prompts": ["def ", " "]}, "prompts"),
    ({"prompts": ["a", "a"]}, "prompts"),
    ({"prompts": [str(i) for i in range(MAX_PROMPTS + 1)]}, "prompts"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"every": 0}, "every"),
    ({"every": "epoch"}, "every"),
    ({"every": True}, "every"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"chat": "yes"}, "chat"),
])
def test_bad_settings_are_refused_with_one_line_naming_the_key(options, key):
    with pytest.raises(ArgumentError) as err:
        SamplesCallback(**{"prompts": ["def "], **options})
    assert err.value.key == key and str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


def test_a_model_that_cannot_generate_fails_when_the_run_starts(tmp_path):
    """An MLP classifier cannot answer prompts: the run fails at its start with one line,
    before any step."""
    trainer = make_trainer(tmp_path / "run", max_steps=5, callbacks=[SamplesCallback(prompts=["hi"])])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert str(err.value) == "samples: MLPClassifier is not a causal LM with generate()"
    assert trainer.state.global_step == 0
    before = weights(trainer)
    assert_same_weights(trainer.model, before)


def test_a_prompt_too_long_for_the_context_fails_when_the_run_starts(tmp_path, finetune_workspace):
    """The tiny Llama's context is 256 tokens: a prompt of about 300 fails the run at its start."""
    callback = SamplesCallback(prompts=["What is 2 plus 3? " * 40], max_new_tokens=8)
    with pytest.raises(ValueError, match=r"^samples: the prompt 'What is 2 plus 3.*\.\.\. has \d+ tokens; with "
                                         r"max_new_tokens 8 that exceeds the model's context of 256 tokens$"):
        llama_trainer(finetune_workspace, tmp_path / "run", callbacks=[callback]).train()


def test_eval_mode_gives_every_module_back_the_mode_it_had():
    """A module the user keeps in eval mode inside a training model stays so after a sample
    (model.train() would switch it on), and every switch goes through train()."""
    model = lm_model(dropout=0.1)
    model.drop.eval()
    switched = []
    original = type(model.drop).train
    model.drop.train = lambda mode=True: (switched.append(mode), original(model.drop, mode))[1]
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and not model.drop.training and all(b.training for b in model.blocks)
    assert switched == [False, True, False]  # eval(), the parent's train(True), its own eval again

