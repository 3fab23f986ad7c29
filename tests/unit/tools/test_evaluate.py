"""The quality report on the shipped reference model and decoder."""

import json

from stateblock.app.cli import main
from stateblock.model.vocab import NO_EOS
from stateblock.tools.evaluate import BUCKETS, METRICS, bucket_of, miss, score
from stateblock.train.tasks import Example
from tests.helpers import REFERENCE_BASE, REFERENCE_DECODER

EOS = 2


def test_score_definitions():
    s = score([5, 6, EOS], ([5, 6, EOS, 9], 2), [5, 6], EOS)
    assert s["exact"] and s["eos"] and s["t_truth"] and s["r_truth"] and s["agree"] == 3
    assert not s["eos_early"] and not s["eos_late"]
    s = score([5, 6, EOS], ([5, 7, 8, 9], NO_EOS), [5, 6], EOS)
    assert not s["exact"] and not s["eos"] and s["agree"] == 1 and not s["r_truth"]
    assert s["eos_late"] and not s["eos_early"]  # never stopped: late
    s = score([5, 6, 7, EOS], ([5, EOS, 7, 8], 1), [5, 6, 7], EOS)
    assert s["eos_early"] and not s["eos_late"] and not s["eos"]
    s = score([5, 6, 6, 6], ([5, 6, 6, 6], NO_EOS), [5, 6], EOS)  # teacher never stopped
    assert s["exact"] and not s["t_truth"]
    assert (
        bucket_of(1) == "1-64"
        and bucket_of(2048) == "1025-2048"
        and bucket_of(3072) == "2049-3072"
        and bucket_of(9000) == "2049-3072"
    )


def test_eval_command_reports_every_bucket_and_family(tmp_path):
    out = tmp_path / "q.json"
    png = tmp_path / "q.png"
    md = tmp_path / "q.md"
    rc = main(
        [
            "eval",
            "--base",
            str(REFERENCE_BASE),
            "--decoder",
            str(REFERENCE_DECODER),
            "--n-each",
            "2",
            "--families",
            "copy,add,count",
            "--device",
            "cpu",
            "--max-answer",
            "96",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["buckets"]) == [f"{lo}-{hi}" for lo, hi in BUCKETS]
    assert set(report["families"]) == {"copy", "add", "count"}
    for entry in [*report["buckets"].values(), *report["families"].values()]:
        assert set(METRICS) | {"n"} == set(entry)
    assert sum(b["n"] for b in report["buckets"].values()) == 6
    for fam in report["families"].values():
        assert fam["n"] == 2 and 0.0 <= fam["token_agreement_vs_teacher"] <= 1.0
    wrong = sum(
        round((1 - f["exact_match_vs_teacher"]) * f["n"]) for f in report["families"].values()
    )
    assert len(report["misses"]) == wrong  # every prompt not exact, listed once
    assert all(m["kind"] in ("token", "eos_early", "eos_late") for m in report["misses"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| copy | 2 |" in md.read_text()


def test_a_miss_says_where_and_how_the_readout_left_the_teacher():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(REFERENCE_BASE), local_files_only=True)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    ex = Example("copy", "copy: hello", "hello")
    truth = ids("hello")
    teacher = truth + [eos]

    def miss_of(teacher, readout):
        return miss(ex, score(teacher, readout, truth, eos), teacher, readout, tok, eos)

    m = miss_of(teacher, (ids("hallo") + [eos], 5))
    assert (m["kind"], m["at"], m["teacher_right"], m["readout_right"]) == ("token", 1, True, False)
    assert (m["teacher"], m["readout"], m["readout_len"]) == ("hello", "hallo", 5)
    m = miss_of(teacher, (ids("hel") + [eos, 5, 5], 3))
    assert (m["kind"], m["at"], m["readout_len"]) == ("eos_early", 3, 3)
    m = miss_of(teacher, (ids("hellooo"), NO_EOS))  # never stopped within the read
    assert (m["kind"], m["at"], m["readout_len"]) == ("eos_late", 5, None)
    assert not m["readout_right"]
    m = miss_of(ids("hellp") + [eos], (ids("hello") + [eos], 5))  # the teacher wrong
    assert not m["teacher_right"] and m["readout_right"] and m["bucket"] == "1-64"


def _two_pass_copy(tmp_path):
    """The shipped decoder's weights run with two refinement passes, a second decoder that
    reads differently (its one shared refinement stack was trained for one pass) and whose
    digest still holds (the digest is of the weights)."""
    import shutil

    d = tmp_path / "two-passes"
    shutil.copytree(REFERENCE_DECODER, d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["decoder_config"]["refine"] = 2
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_several_decoders_share_one_teacher_pass(tmp_path, monkeypatch, capsys):
    from stateblock.tools import evaluate

    calls = []
    real = evaluate.greedy_answers

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "greedy_answers", counted)
    other = _two_pass_copy(tmp_path)
    common = ["--base", str(REFERENCE_BASE), "--n-each", "3", "--families", "copy,sort,recall"]
    common += ["--device", "cpu", "--max-answer", "96"]
    single, both = tmp_path / "one.json", tmp_path / "two.json"
    md = tmp_path / "two.md"
    assert main(["eval", *common, "--decoder", str(REFERENCE_DECODER), "--json", str(single)]) == 0
    capsys.readouterr()
    argv = ["eval", *common, "--decoder", str(REFERENCE_DECODER), "--decoder", str(other)]
    assert main([*argv, "--json", str(both), "--markdown", str(md)]) == 0
    assert len(calls) == 2  # one teacher pass per command, not one per decoder
    table = capsys.readouterr().out
    reports = json.loads(both.read_text())
    alone = json.loads(single.read_text())
    assert [r["settings"]["decoder"] for r in reports] == [str(REFERENCE_DECODER), str(other)]
    # the first decoder's report is the one it gets alone
    assert reports[0]["buckets"] == alone["buckets"] and reports[0]["misses"] == alone["misses"]
    assert reports[0]["settings"]["decoder_digest"] == reports[1]["settings"]["decoder_digest"]
    assert reports[0]["families"] != reports[1]["families"]  # a second pass reads differently
    for r in reports:
        row = next(
            line
            for line in table.splitlines()
            if line.startswith(f"| {r['settings']['decoder']} |")
        )
        assert row.split(" | ")[1] == str(len(r["misses"]))
    assert table in md.read_text() and md.read_text().count("### By family") == 2


def test_several_decoders_take_no_plot(tmp_path):
    argv = ["eval", "--decoder", str(REFERENCE_DECODER), "--decoder", str(REFERENCE_DECODER)]
    assert main([*argv, "--plot", str(tmp_path / "q.png"), "--device", "cpu"]) == 2


def test_eval_reads_the_rows_the_compiled_capture_gives(tmp_path):
    """`--capture-compile`: the readouts read the rows of the compiled backbone, unmasked, as
    the capture service runs it on a GPU; on the CPU in float32 those are the eager rows, so
    the report is the masked eager one's, with the rotary table too, and it says what it
    read."""
    common = ["eval", "--base", str(REFERENCE_BASE), "--decoder", str(REFERENCE_DECODER)]
    common += ["--n-each", "2", "--families", "copy,reverse", "--device", "cpu"]
    common += ["--max-answer", "96"]
    eager, compiled = tmp_path / "eager.json", tmp_path / "compiled.json"
    assert main([*common, "--json", str(eager)]) == 0
    assert main([*common, "--capture-compile", "aot_eager", "--json", str(compiled)]) == 0
    a, b = json.loads(eager.read_text()), json.loads(compiled.read_text())
    assert a["settings"]["capture_compile"] == "off" and a["settings"]["capture_rope"] is None
    assert b["settings"]["capture_compile"] == "aot_eager"
    assert b["settings"]["capture_rope"] == "fused"
    assert b["buckets"] == a["buckets"] and b["misses"] == a["misses"]
    # the rotary table (STATEBLOCK_CAPTURE_ROPE=table): float32 here, so eager's values again
    table = tmp_path / "table.json"
    flags = ["--capture-compile", "aot_eager", "--capture-rope", "table", "--json", str(table)]
    assert main([*common, *flags]) == 0
    c = json.loads(table.read_text())
    assert c["settings"]["capture_rope"] == "table"
    assert c["buckets"] == a["buckets"] and c["misses"] == a["misses"]
