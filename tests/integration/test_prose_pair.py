"""The prose pair end to end at the tiny scale (issue 41): `stateblock build-reference --recipe
prose` on the committed sample runs base -> tasks -> tuned base -> teacher -> readout ->
evaluation, a second run skips every stage, the distilled readout agrees with its teacher far
more than the same decoder untrained, and `stateblock up` with the pair answers a held-out
prose prompt through the official openai client with exactly the readout's own answer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch

from stateblock.app import cli
from stateblock.app.stack import StackThread, UpConfig
from stateblock.model.capture import lm_head_weight
from stateblock.model.checkpoint import load_decoder
from stateblock.model.loading import load_base
from stateblock.train import corpus, distill, prose_fidelity, prose_readout
from stateblock.train.prose_readout import read_records

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "prose_sample" / "docs.jsonl"
TINY = prose_readout.SCALES["tiny"]


def _build(root: Path) -> int:
    return cli.main(["build-reference", "--recipe", "prose", "--scale", "tiny", "--device", "cpu",
                     "--corpus", str(root / "corpus"), "--work-dir", str(root / "work"),
                     "--out", str(root / "pair")])  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Iterator[Path]:
    """The sample split a quarter held out, and the pair built from it. One thread a
    process (the base stage's too): on two cores shared with other work, two threads each
    ran the chain several times slower."""
    root = tmp_path_factory.mktemp("prose")
    train, heldout = corpus.split(corpus.load_sample(SAMPLE), share=0.25)
    (root / "corpus").mkdir()
    corpus.write_documents(train, root / "corpus" / "train.txt")
    corpus.write_documents(heldout, root / "corpus" / "heldout.txt")
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        assert _build(root) == 0
        yield root
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env


def test_the_chain_writes_every_stage_and_resumes_past_them(built):
    work = built / "work"
    summary = json.loads((work / "summary.json").read_text())
    assert summary["readout"]["family"]["all"]["n"] == TINY.heldout_prompts
    assert set(summary["readout"]["family"]) == {"all", "repeat", "next_sentence", "next_word",
                                                 "question", "continue"}  # fmt: skip
    assert summary["base"]["continuations"]["n"] > 0
    assert "| next_word |" in (work / "summary.md").read_text()
    manifest = built / "pair" / "decoder" / "manifest.json"
    stamp = manifest.stat().st_mtime_ns, (work / "summary.json").stat().st_mtime_ns
    assert json.loads(manifest.read_text())["training"]["config"]["max_answer"] == TINY.max_answer
    assert _build(built) == 0  # every output exists: nothing runs again
    assert (json.loads((work / "decoder" / "manifest.json").read_text())["decoder_digest"]
            == json.loads(manifest.read_text())["decoder_digest"])  # fmt: skip
    assert (work / "summary.json").stat().st_mtime_ns == stamp[1]


def test_the_readout_learned_its_teacher(built):
    """Token agreement with the teacher on held-out prompts: the distilled readout against
    the same decoder at its initialisation (1,024 tokens: chance is about 0.001)."""
    work = built / "work"
    summary = json.loads((work / "summary.json").read_text())
    base, tok = load_base(work / "tuned")
    fresh = distill.new_decoder(base, tok, lm_head_weight(base), TINY.distill, "cpu").eval()
    held = read_records(work / "teacher" / "heldout.jsonl")
    before = prose_fidelity.fidelity(base, fresh, held, TINY.max_answer, tok.eos_token_id,
                                     tok.pad_token_id, "cpu")  # fmt: skip
    after = summary["readout"]["family"]["all"]["token_agreement"]
    assert after > 0.15 and after > 3 * before["family"]["all"]["token_agreement"]


def test_up_serves_the_pair_with_the_readouts_answers(built, tmp_path):
    work, pair = built / "work", built / "pair"
    readouts = read_records(work / "readouts.jsonl")
    held = read_records(work / "teacher" / "heldout.jsonl")
    _, tok = load_base(pair / "base")
    with _up(pair / "base", pair / "decoder", tmp_path / "stack", workers=2) as (config, client):
        for k in (0, 1, 2):
            want = readouts[k]
            got = client.completions.create(model=config.model_name, prompt=held[k]["prompt"],
                                            max_tokens=TINY.max_answer, temperature=0)  # fmt: skip
            text = tok.decode([t for t in want if t != tok.eos_token_id], skip_special_tokens=True)
            assert got.choices[0].text == text
            assert got.choices[0].finish_reason == (
                "stop" if tok.eos_token_id in want else "length"
            )
            assert any(c.isalpha() for c in text)  # words, from a 1,024-token BPE


@contextmanager
def _up(base_dir: Path, decoder_dir: Path, data_dir: Path, workers: int):
    """`stateblock up` in this process with the pair: (its config, an openai client of it)."""
    config = UpConfig(data_dir=data_dir, http_port=0, grpc_port=0, workers=workers,
                      base_dir=base_dir, decoder_dir=decoder_dir, request_timeout_s=60.0)  # fmt: skip
    runner = StackThread(config)
    urls = runner.start(timeout=120)
    try:
        yield config, openai.OpenAI(base_url=f"{urls.http}/v1", api_key="-", max_retries=0)
    finally:
        runner.stop()


def test_the_served_check_reports_the_served_answers_against_the_teacher(built):
    """bench.prose_api on the tiny pair, over the held-out documents as its texts: every
    prompt answered through the API, the answers those of the readout in this process, and
    the figures of exactly those answers."""
    from bench import prose_api

    pair = built / "pair"
    result = prose_api.run(pair, built / "corpus" / "heldout.txt", n=6, seed=3,
                           cap=TINY.max_answer)  # fmt: skip
    assert result["prompts"] == 6 and result["served"]["family"]["all"]["n"] == 6
    base, tok = load_base(pair / "base")
    dec, _ = load_decoder(pair / "decoder", base_dir=pair / "base", lm_head=lm_head_weight(base))
    records = [{"prompt_ids": tok(a["prompt"])["input_ids"]} for a in result["answers"]]
    mine = prose_fidelity.readout_answers(base, dec.eval(), records, TINY.max_answer,
                                          tok.pad_token_id, "cpu")  # fmt: skip
    eos = tok.eos_token_id
    for answer, tokens in zip(result["answers"], mine, strict=True):
        want = prose_fidelity.cut(tokens, eos)
        assert answer["text"] == tok.decode([t for t in want if t != eos],
                                            skip_special_tokens=True)  # fmt: skip
        assert answer["finish_reason"] == ("stop" if eos in want else "length")
    same = [a["text"] == a["teacher"] and (a["finish_reason"] == "stop") == a["teacher_stopped"]
            for a in result["answers"]]  # fmt: skip
    assert result["served"]["family"]["all"]["exact"] == round(sum(same) / 6, 4)


def test_a_call_that_distils_alone_goes_on_from_another_call_s_decoder(built, tmp_path):
    """What a distillation call carries: the tuned base and the teacher, no document-trained
    base, no prompts and no corpus, and the decoder an earlier call returned, whose weights
    start the run."""
    import shutil

    work = built / "work"
    again = tmp_path / "work"
    for stage in ("tuned", "teacher"):
        shutil.copytree(work / stage, again / stage)
    base, tok = load_base(work / "tuned")
    identity = distill.base_identity(work / "tuned", lm_head_weight(base))
    fresh = distill.new_decoder(base, tok, lm_head_weight(base), TINY.distill, "cpu")
    distill.start_from(fresh, work / "decoder", identity, "cpu")
    prev, _ = load_decoder(work / "decoder", base_dir=work / "tuned", lm_head=lm_head_weight(base))
    for k, v in prev.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v.float()), k
    with pytest.raises(ValueError, match="another base"):
        distill.start_from(fresh, work / "decoder", {**identity, "lm_head_digest": "x"}, "cpu")
    assert prose_readout.main(["--work", str(again), "--scale", "tiny",
                               "--base-weights", str(tmp_path / "no-such-base"),
                               "--distill-init", str(work / "decoder"),
                               "--distill-minutes", "0.1"]) == 0  # fmt: skip
    summary = json.loads((again / "summary.json").read_text())
    assert summary["decoder"]["config"]["init"] == str(work / "decoder")
    assert not (again / "tasks" / "train.jsonl.gz").exists()  # no prompts were made


@pytest.mark.parametrize("option", [("--copy=twin", "--copy-guess=2"), ("--row-tokens",)])
def test_a_readout_that_reads_token_ids_distils_and_is_evaluated(built, tmp_path, option):
    """`--copy twin`: the decoder trains through the copy mixture (the base's two likeliest
    first tokens among its candidates), carries its tokenizer's twin spellings in its
    weights, and the evaluation reads it with the prompts' ids; `--row-tokens` the same with
    the tokens on the rows."""
    import shutil

    work, again = built / "work", tmp_path / "work"
    for stage in ("tuned", "teacher"):
        shutil.copytree(work / stage, again / stage)
    assert prose_readout.main(["--work", str(again), "--scale", "tiny", *option,
                               "--base-weights", str(tmp_path / "no-such-base"),
                               "--distill-minutes", "0.1"]) == 0  # fmt: skip
    base, tok = load_base(again / "tuned")
    dec, manifest = load_decoder(again / "decoder", base_dir=again / "tuned",
                                 lm_head=lm_head_weight(base))  # fmt: skip
    want = (
        {"copy": "twin", "row_tokens": False, "copy_guess": 2}
        if "--copy=twin" in option
        else {"copy": "", "row_tokens": True, "copy_guess": 0}
    )
    assert {k: manifest["decoder_config"][k] for k in want} == want
    if want["copy"]:
        vocab = tok.get_vocab()
        the = vocab.get("\u0120the")
        assert the is not None and int(dec.twins[the]) == vocab["the"]
    summary = json.loads((again / "summary.json").read_text())
    assert {k: summary["decoder"]["config"]["decoder"][k] for k in want} == want
    assert summary["readout"]["family"]["all"]["n"] == TINY.heldout_prompts
    assert 0.0 < summary["readout"]["family"]["all"]["token_agreement"] <= 1.0
    _served_as_offline(again, dec.eval(), base, tok, tmp_path / "stack")


def _served_as_offline(work: Path, dec, base, tok, data_dir: Path) -> None:
    """`stateblock up` with the decoder (the reference engine: blocks carry the prompts'
    ids) answers held-out prompts through the openai client as the decoder does here."""
    held = read_records(work / "teacher" / "heldout.jsonl")[:3]
    mine = prose_fidelity.readout_answers(base, dec, held, TINY.max_answer, tok.pad_token_id,
                                          "cpu")  # fmt: skip
    with _up(work / "tuned", work / "decoder", data_dir, workers=1) as (config, client):
        for record, tokens in zip(held, mine, strict=True):
            want = prose_fidelity.cut(tokens, tok.eos_token_id)
            got = client.completions.create(model=config.model_name, prompt=record["prompt"],
                                            max_tokens=TINY.max_answer, temperature=0)  # fmt: skip
            text = tok.decode([t for t in want if t != tok.eos_token_id], skip_special_tokens=True)
            assert got.choices[0].text == text
