"""GSM8K loading: row counts, ground-truth extraction, and malformed lines named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr.task.data import DataError, Example, extract_gsm8k_answer, load_examples, load_gsm8k_jsonl
from rlvr.task.grading import grade


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def row(question: str = "q?", answer: str = "work\n#### 7") -> str:
    return json.dumps({"question": question, "answer": answer})


# --- the shared GSM8K copy ---------------------------------------------------------------------


@pytest.mark.parametrize("split, n_rows", [("train", 7473), ("test", 1319)])
def test_gsm8k_split_sizes_and_every_ground_truth_grades_as_itself(gsm8k_real_path, split, n_rows):
    examples = load_gsm8k_jsonl(gsm8k_real_path / f"{split}.jsonl")
    assert len(examples) == n_rows
    assert all(e.question and e.ground_truth and e.ground_truth == e.ground_truth.strip() for e in examples)
    assert all(grade(e.ground_truth, e.ground_truth) for e in examples)


def test_gsm8k_known_rows(gsm8k_real_path):
    train = load_gsm8k_jsonl(gsm8k_real_path / "train.jsonl")
    test = load_gsm8k_jsonl(gsm8k_real_path / "test.jsonl")
    assert train[0].question.startswith("Natalia sold clips to 48 of her friends in April")
    assert train[0].ground_truth == "72"
    assert test[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert test[0].ground_truth == "18"
    # thousands commas are kept in the ground truth (the grader ignores them)
    assert test[146].ground_truth == "2,125"
    assert grade("2125", test[146].ground_truth)
    assert train[5715].ground_truth == "-7"
    # calculator annotations <<...>> are dropped from the rationale, the "####" line too
    assert "<<" not in test[0].solution and "####" not in test[0].solution
    assert "She makes 9 * 2 = $18 every day" in test[0].solution


def test_load_examples_from_a_directory_a_file_and_with_a_limit(gsm8k_real_path):
    by_dir = load_examples(str(gsm8k_real_path), split="test", limit=5)
    by_file = load_examples(str(gsm8k_real_path / "test.jsonl"), limit=5)
    assert by_dir == by_file
    assert [e.ground_truth for e in by_dir] == ["18", "3", "70000", "540", "20"]


# --- ground-truth extraction -------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("2 + 2 = 4\n#### 4", "4"),
        ("#### 2,125", "2,125"),
        ("a #### b\n####   -3  \n", "-3"),  # the last marker wins, surrounding space stripped
        ("x\n#### 0.5", "0.5"),
    ],
)
def test_extract_gsm8k_answer(answer, truth):
    assert extract_gsm8k_answer(answer) == truth


def test_extract_gsm8k_answer_without_marker_is_an_error():
    with pytest.raises(DataError, match="####"):
        extract_gsm8k_answer("the answer is 4")


def test_jsonl_rows_become_examples(tmp_path):
    path = write_jsonl(
        tmp_path / "tiny.jsonl", [row("How many?", "3 + 4 = <<3+4=7>>7\n#### 7"), "", row("Big?", "#### 1,000")]
    )
    examples = load_gsm8k_jsonl(path)
    assert examples == [Example("How many?", "7", "3 + 4 = 7"), Example("Big?", "1,000", "")]


# --- malformed lines: errors that name the file and the line -----------------------------------


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "string fields 'question' and 'answer'"),
        (json.dumps({"question": "q?"}), "string fields 'question' and 'answer'"),
        (json.dumps({"question": 3, "answer": "#### 3"}), "string fields 'question' and 'answer'"),
        (json.dumps({"question": "q?", "answer": "no marker"}), "####"),
        (json.dumps({"question": "q?", "answer": "work ####   "}), "empty"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    # line 3 is bad; the blank line 2 still counts in the numbering
    path = write_jsonl(tmp_path / "broken.jsonl", [row(), "", bad_line, row()])
    with pytest.raises(DataError) as info:
        load_gsm8k_jsonl(path)
    assert "broken.jsonl:3:" in str(info.value)
    assert message in str(info.value)


def test_nothing_is_skipped_silently(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [row(), row(), "{oops"])
    with pytest.raises(DataError, match=r"d\.jsonl:3"):
        load_gsm8k_jsonl(path)
    # with a limit that stops before the bad line, the good rows load
    assert len(load_gsm8k_jsonl(path, limit=2)) == 2


def test_missing_file_is_an_error_that_says_what_to_pass(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_gsm8k_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no such file"):
        load_examples(str(tmp_path / "nope.jsonl"))


def test_directory_source_reads_the_split_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [row("t?", "#### 1")])
    write_jsonl(tmp_path / "test.jsonl", [row("v?", "#### 2"), row("w?", "#### 3")])
    assert [e.ground_truth for e in load_examples(str(tmp_path), split="train")] == ["1"]
    assert [e.ground_truth for e in load_examples(str(tmp_path), split="test")] == ["2", "3"]


def test_missing_local_path_is_an_error_not_a_hub_lookup(tmp_path):
    from rlvr.task.data import DataError, load_examples

    with pytest.raises(DataError, match="cannot load data"):
        load_examples(str(tmp_path / "no" / "such" / "gsm8k"))
    with pytest.raises(DataError, match="cannot load data"):
        load_examples("./data/gsm8k")


# --- other files, columns and answer formats ---------------------------------------------------


def custom_rows():
    return [
        {"problem": "What is 1/2 + 1/2?", "solution": "It is $\\boxed{1}$.", "level": 2},
        {"problem": "Simplify x + x.", "solution": "We get \\boxed{2x}.", "level": 3},
    ]


def write_table(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the file type of ``path``'s suffix."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, [json.dumps(r) for r in rows])
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_file_type_with_mapped_columns_and_boxed_answers(tmp_path, suffix):
    path = write_table(tmp_path / f"math{suffix}", custom_rows())
    examples = load_examples(str(path), question_field="problem", answer_field="solution", answer_format="boxed")
    assert [(e.question, e.ground_truth) for e in examples] == [("What is 1/2 + 1/2?", "1"), ("Simplify x + x.", "2x")]
    level = [e.meta["level"] for e in examples]
    assert level == (["2", "3"] if suffix == ".csv" else [2, 3])  # CSV has no types; the rest keep theirs
    assert examples[0].solution == "It is $\\boxed{1}$."


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv"])
def test_a_folder_holds_the_split_as_one_file_or_shards(tmp_path, suffix):
    rows = [{"q": f"q{i}", "a": i} for i in range(5)]
    write_table(tmp_path / f"train{suffix}", rows[:3])
    (tmp_path / "data").mkdir()
    write_table(tmp_path / "data" / f"test-00000-of-00002{suffix}", rows[3:4])
    write_table(tmp_path / "data" / f"test-00001-of-00002{suffix}", rows[4:])
    kw = dict(question_field="q", answer_field="a", answer_format="raw")
    assert [e.ground_truth for e in load_examples(str(tmp_path), "train", **kw)] == ["0", "1", "2"]
    assert [e.ground_truth for e in load_examples(str(tmp_path), "test", **kw)] == ["3", "4"]
    assert [e.ground_truth for e in load_examples(str(tmp_path), "test", limit=1, **kw)] == ["3"]
    with pytest.raises(DataError, match=r"no validation file .*splits there: test, train"):
        load_examples(str(tmp_path), "validation", **kw)


def test_raw_answers_and_every_other_column_reaches_meta(tmp_path):
    path = write_table(
        tmp_path / "d.jsonl",
        [{"prompt": "Capital of France?", "target": " Paris ", "lang": "en", "aliases": ["Paris", "paris"]}],
    )
    [ex] = load_examples(str(path), question_field="prompt", answer_field="target", answer_format="raw")
    assert ex.ground_truth == "Paris" and ex.meta == {"lang": "en", "aliases": ["Paris", "paris"]}


@pytest.mark.parametrize(
    "suffix, where", [(".jsonl", ":2:"), (".json", ":6:"), (".csv", ":3:"), (".parquet", ": row 2:")]
)
def test_a_row_without_the_column_names_file_and_line_and_the_fix(tmp_path, suffix, where):
    rows = [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "no marker"}]
    path = write_table(tmp_path / f"bad{suffix}", rows)
    with pytest.raises(DataError) as info:
        load_examples(str(path))
    assert f"bad{suffix}{where}" in str(info.value) and "####" in str(info.value)
    with pytest.raises(
        DataError,
        match=rf"bad\{suffix}\S*: .*no column 'problem' \(columns: question, answer\); "
        "set data.question_field",
    ):
        load_examples(str(path), question_field="problem")


def test_boxed_format_needs_a_box_and_unknown_formats_are_refused(tmp_path):
    path = write_table(tmp_path / "d.jsonl", [{"question": "q", "answer": "no box here"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the answer has no \\boxed"):
        load_examples(str(path), answer_format="boxed")
    with pytest.raises(DataError, match="answer_format 'latex': choose one of gsm8k, boxed, raw"):
        load_examples(str(path), answer_format="latex")


HUB_STYLE_README = """---
configs:
- config_name: algebra
  data_files:
  - {split: test, path: algebra/test.jsonl}
- config_name: geometry
  data_files:
  - {split: test, path: geometry/test.jsonl}
---
"""


def test_a_hub_dataset_gets_its_config_split_and_columns(tmp_path, monkeypatch):
    """``datasets`` itself reads a dataset laid out as on the hub (a README naming configs and their splits'
    files); rlvr passes the config and split and maps the columns."""
    import datasets

    from rlvr.task import data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    repo = tmp_path / "math"
    repo.mkdir()
    (repo / "README.md").write_text(HUB_STYLE_README)
    for config, row in [
        ("algebra", {"problem": "1+1?", "solution": "so \\boxed{2}", "type": "Algebra"}),
        ("geometry", {"problem": "sides?", "solution": "\\boxed{3}", "type": "Geo"}),
    ]:
        (repo / config).mkdir()
        write_table(repo / config / "test.jsonl", [row])
    fmt = data.RowFormat("problem", "solution", "boxed")
    [ex] = data.load_hub(str(repo), "test", config="algebra", fmt=fmt)
    assert (ex.question, ex.ground_truth, ex.meta) == ("1+1?", "2", {"type": "Algebra"})
    [ex] = data.load_hub(str(repo), "test", config="geometry", fmt=fmt)
    assert (ex.question, ex.ground_truth) == ("sides?", "3")
    with pytest.raises(DataError, match="config algebra, split train"):
        data.load_hub(str(repo), "train", config="algebra", fmt=fmt)


def test_an_owner_slash_name_source_goes_to_the_hub_loader(monkeypatch):
    from rlvr.task import data

    calls = []
    monkeypatch.setattr(data, "load_hub", lambda *args: calls.append(args) or [])
    load_examples("someone/math", "test", question_field="problem", answer_field="solution", config="algebra")
    load_examples("openai/gsm8k", "train")
    assert calls == [
        ("someone/math", "test", None, "algebra", data.RowFormat("problem", "solution", "gsm8k")),
        ("openai/gsm8k", "train", None, None, data.RowFormat("question", "answer", "gsm8k")),
    ]
