"""The prose tasks on the committed sample: every determined answer is decided by its prompt
(the quoted sentence and word occur once, the answer is in the passage), the draws are
reproducible, a split's prompts quote only that split's documents, and the teacher's and
evaluation's figures mean what they say."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from stateblock.train import corpus, prose_fidelity, prose_tasks

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "prose_sample" / "docs.jsonl"


@pytest.fixture(scope="module")
def split() -> tuple[list[str], list[str]]:
    train, heldout = corpus.split(corpus.load_sample(SAMPLE), share=0.25)
    return [d.text for d in train], [d.text for d in heldout]


def _solve(e: prose_tasks.Example) -> str:
    """The answer, read back from the prompt alone (no generator state)."""
    if e.family == "repeat":
        return e.prompt.removeprefix("Repeat this sentence: ")
    text, ask = e.prompt.rsplit("\n", 1)
    sents = prose_tasks.sentences(text)
    quoted = re.search(r'"(.*)"', ask).group(1)
    if e.family == "next_sentence":
        return sents[sents.index(quoted) + 1]
    words = [prose_tasks._word(w) for w in text.split()]
    if e.family == "next_word":
        assert sum(w.lower() == quoted.lower() for w in words) == 1
        return words[[w.lower() for w in words].index(quoted.lower()) + 1]
    (hit,) = [
        s for s in sents if quoted.lower() in (prose_tasks._word(w).lower() for w in s.split())
    ]
    return hit


def test_every_determined_answer_follows_from_its_prompt(split):
    exs = prose_tasks.generate(split[0], 300, seed=3)
    assert set(Counter(e.family for e in exs)) == set(prose_tasks.FAMILIES)
    assert len({e.prompt for e in exs}) == 300
    for e in exs:
        if e.determined:
            assert e.answer and _solve(e) == e.answer, e
        else:
            assert e.answer not in e.prompt  # the text's own next sentence, not quoted


def test_draws_are_reproducible_and_stay_in_their_split(split):
    train, heldout = split
    a = prose_tasks.generate(heldout, 50, seed=7)
    assert a == prose_tasks.generate(heldout, 50, seed=7)
    assert a != prose_tasks.generate(heldout, 50, seed=8)
    held_ids = {prose_tasks.doc_id(d) for d in heldout}
    assert {e.doc for e in a} <= held_ids
    assert not {e.doc for e in prose_tasks.generate(train, 50, seed=7)} & held_ids


def test_too_few_documents_is_a_clear_error():
    with pytest.raises(ValueError, match="make only"):
        prose_tasks.generate(["One. Two."], 3, seed=0)


def test_the_figures_of_one_answer():
    eos = 2
    assert prose_fidelity.compare([5, 6, eos], [5, 6, eos, 9], eos) == {
        "exact": True, "tokens": 1.0, "eos": True, "ends": None}  # fmt: skip
    wrong = prose_fidelity.compare([5, 6, eos], [5, 7, 8, eos], eos)
    assert wrong == {"exact": False, "tokens": pytest.approx(1 / 3), "eos": False, "ends": "late"}
    assert prose_fidelity.compare([5, 6, eos], [5, eos], eos)["ends"] == "early"
    assert prose_fidelity.compare([5, 6, eos], [5, 6, 7], eos)["ends"] == "late"  # no end
    assert prose_fidelity.compare([5, 6], [5, eos], eos)["ends"] == "early"  # the cap's answer
    assert prose_fidelity.compare([5, 6], [5, 6, 7], eos)["exact"] is False  # cap: all 3 read
    report = prose_fidelity.base_report(
        [{"family": "repeat", "answer_ids": [5, eos], "truth_ids": [5]},
         {"family": "repeat", "answer_ids": [6, eos], "truth_ids": [5]},
         {"family": "continue", "answer_ids": [7, 8, 9, 10, 7, 8, 9, 10], "truth_ids": None}],
        eos,
    )  # fmt: skip
    assert report["exact_vs_truth"] == {"repeat": 0.5}
    assert report["continuations"]["distinct4"] == pytest.approx(4 / 5)
    assert report["continuations"]["ended_with_eos"] == 0.0


def test_a_stage_checkpoint_becomes_a_base_and_tasks_stop_alone(tmp_path, split):
    """What a GPU call starts from: `--until tasks` writes the prompts and nothing else, and
    a `prose_stage` checkpoint (bf16 parts) with its tokenizer becomes a base directory."""
    import torch

    from stateblock.model.loading import load_base
    from stateblock.train import base_ddp, prose_readout, prose_tokenizer, weights

    scale = prose_readout.SCALES["tiny"]
    (tmp_path / "corpus").mkdir()
    for name, docs in zip(("train", "heldout"), split, strict=True):
        (tmp_path / "corpus" / f"{name}.txt").write_text("\n\n".join(docs) + "\n")
    args = ["--corpus", str(tmp_path / "corpus"), "--work", str(tmp_path / "w"), "--scale", "tiny"]
    assert prose_readout.main([*args, "--until", "tasks"]) == 0
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["tasks"]
    held = prose_tasks.read(tmp_path / "w" / "tasks" / "heldout.jsonl.gz")
    assert len(held) == scale.heldout_prompts

    tok_dir = tmp_path / "tok"
    prose_tokenizer.save_bpe(prose_tokenizer.train_bpe(split[0], scale.vocab_size), tok_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    # a stage base of another shape than the scale's: its shape arguments say which
    shape_args = scale.base_args + " --n-layers 3 --dim 96"
    shape = base_ddp.parse_args(["--out", "-", "--corpus", "-", "--tokenizer", "-",
                                 *shape_args.split()])  # fmt: skip
    model = base_ddp.build_model(tok, shape)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    (tmp_path / "stage").mkdir()
    weights.save_split(sd, tmp_path / "stage" / "base", max_bytes=100_000)  # several parts
    with pytest.raises(RuntimeError, match="size mismatch"):  # in the scale's shape
        prose_readout.from_stage_weights(tmp_path / "stage" / "base", tok_dir, tmp_path / "a",
                                         scale.base_args)  # fmt: skip
    assert not (tmp_path / "a").exists()
    prose_readout.from_stage_weights(tmp_path / "stage" / "base", tok_dir, tmp_path / "b",
                                     shape_args)  # fmt: skip
    loaded, ltok = load_base(tmp_path / "b")
    assert len(ltok) == len(tok) and loaded.config.vocab_size == scale.vocab_size
    assert (loaded.config.num_hidden_layers, loaded.config.hidden_size) == (3, 96)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k].float()), k


def test_sharded_prompts_are_distinct_reproducible_and_drawn_from_every_shard(split):
    train = split[0]
    exs = prose_tasks.generate_sharded(train, 200, seed=5, workers=2)
    assert len(exs) == 200 and len({e.prompt for e in exs}) == 200
    assert exs == prose_tasks.generate_sharded(train, 200, seed=5, workers=2)
    shard_of = {prose_tasks.doc_id(d): k % 2 for k, d in enumerate(train)}
    assert {shard_of[e.doc] for e in exs[:2]} == {0, 1}  # the shards in turn
    assert prose_tasks.generate_sharded(train, 50, seed=5, workers=1) == (
        prose_tasks.generate(train, 50, seed=5)
    )
    for e in exs:
        if e.determined:
            assert _solve(e) == e.answer, e


def test_the_tuning_reads_more_prompts_than_the_teacher_and_a_short_file_is_an_error(
    tmp_path, split
):
    """`--tune-prompts`: the tasks stage writes the tuning's prompts, the teacher takes the
    first train_prompts of them; a split file already there is kept, and one with fewer
    prompts than an arm asks for stops it with what to do."""
    from stateblock.train import prose_readout

    (tmp_path / "corpus").mkdir()
    for name, docs in zip(("train", "heldout"), split, strict=True):
        (tmp_path / "corpus" / f"{name}.txt").write_text("\n\n".join(docs) + "\n")
    work = tmp_path / "w"
    base = ["--corpus", str(tmp_path / "corpus"), "--work", str(work), "--scale", "tiny",
            "--until", "tasks"]  # fmt: skip
    assert prose_readout.main([*base, "--train-prompts", "40", "--tune-prompts", "90",
                               "--task-workers", "2"]) == 0  # fmt: skip
    tasks = work / "tasks"
    assert len(prose_readout.train_tasks(tasks, 90)) == 90
    assert prose_readout.train_tasks(tasks, 40) == prose_readout.train_tasks(tasks, 90)[:40]
    held = (tasks / "heldout.jsonl.gz").read_bytes()
    (tasks / "train.jsonl.gz").unlink()
    assert prose_readout.main([*base, "--train-prompts", "30"]) == 0  # train made again
    assert (tasks / "heldout.jsonl.gz").read_bytes() == held  # held-out kept
    with pytest.raises(SystemExit, match="holds 30 prompts, the scale asks for 90"):
        prose_readout.train_tasks(tasks, 90)
