"""Tasks, sources, splits and tokenisation helpers (no network; tiny offline tokenizer)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import tiny_tokenizer

from loca.data import (
    TASKS,
    DataError,
    DataNotFoundError,
    Example,
    TemplateError,
    encode_choices,
    encode_examples,
    get_task,
    hub_row_to_example,
    load_local,
    load_splits,
    load_task_split,
    load_test,
)
from loca.data.splits import group_ids, load_pool, permutation, shared_with
from loca.data.tasks import context_keys, hellaswag_clean, passage_keys

pytestmark = pytest.mark.unit

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not present")


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n: int, prefix: str = "x", n_choices: int = 2) -> list[dict]:
    return [
        {
            "id": f"{prefix}-{i}",
            "question": f"question {i} ",
            "passage": None,
            "choices": [f"c{j}" for j in range(n_choices)],
            "label": i % n_choices,
        }
        for i in range(n)
    ]


# --- templates -------------------------------------------------------------------------------

EXPECTED_PROMPTS = {
    "sst2": "Review: it 's a charming and often affecting journey .\nSentiment (positive or negative):",
    "boolq": "Windows Movie Maker is a discontinued video editing program by Microsoft.\n"
    "Question: is windows movie maker part of windows essentials?\nAnswer:",
    "arc_easy": "Question: Which technology was developed most recently?\nAnswer:",
    "arc_challenge": "Question: Which property of a mineral can be determined just by looking at "
    "it?\nAnswer:",
    "obqa": "Gas can fill any container it is given, and liquid",
    "hellaswag": "A man is sitting on a roof. he",
}
EXPECTED_COMPLETIONS = {
    "sst2": " positive",
    "boolq": " yes",
    "arc_easy": " cellular telephone",
    "arc_challenge": " luster",
    "obqa": " uses what it needs",
    "hellaswag": " starts pulling up roofing on a roof.",
}


def test_registry_has_the_six_tasks():
    assert set(TASKS) == {"sst2", "boolq", "arc_easy", "arc_challenge", "obqa", "hellaswag"}


@pytest.mark.parametrize("name", sorted(EXPECTED_PROMPTS))
def test_template_renders_fixed_item(name):
    task = get_task(name)
    assert task.prompt(task.sample) == EXPECTED_PROMPTS[name]
    assert task.completion(task.sample) == EXPECTED_COMPLETIONS[name]
    assert task.completion(task.sample, 0) == " " + task.sample.choices[0]


def test_sst2_template_is_exact_and_strips_glue_trailing_space():
    task = get_task("sst2")
    assert task.template == "Review: {question}\nSentiment (positive or negative):"
    ex = Example(question="  good film . ", choices=(" negative", "positive "), label=1)
    assert task.prompt(ex) == "Review: good film .\nSentiment (positive or negative):"
    assert task.completion(ex) == " positive"
    assert task.completion(ex, 0) == " negative"


def test_passage_template_requires_a_passage():
    ex = Example(question="q", choices=("no", "yes"), label=0, id="e1")
    with pytest.raises(ValueError, match="e1"):
        get_task("boolq").prompt(ex)


def test_get_task_unknown_lists_known():
    with pytest.raises(ValueError, match="known tasks: sst2, boolq, arc_easy"):
        get_task("mnli")


def test_template_validation():
    with pytest.raises(TemplateError, match="lacks the {question}"):
        get_task("sst2", template="Review: {passage}")
    with pytest.raises(TemplateError, match="unknown placeholder"):
        get_task("sst2", template="{question} {answer}")
    with pytest.raises(TemplateError, match="malformed"):
        get_task("sst2", template="{question} }")
    t = get_task("sst2", template="S: {question} {{literal}}\nA:")
    ex = Example(question="x", choices=("a", "b"), label=0)
    assert t.prompt(ex) == "S: x {literal}\nA:"
    assert TASKS["sst2"].template.startswith("Review:")  # the registry is untouched
    # a template typed on a command line: backslash-n means newline, double backslash a backslash
    assert get_task("sst2", template="S: {question}\\nA:").template == "S: {question}\nA:"
    assert get_task("sst2", template="S: {question}\\\\n").template == "S: {question}\\n"


def test_user_task_needs_template_and_loads(tmp_path):
    f = write_jsonl(tmp_path / "mine.jsonl", rows(10))
    with pytest.raises(TemplateError, match="needs a template"):
        get_task(str(f))
    with pytest.raises(TemplateError, match="lacks"):
        get_task(str(f), template="no placeholder")
    task = get_task(str(f), template="Q: {question}\nA:")
    assert task.name == "mine"
    exs = load_task_split(task, task.validation_split)
    assert len(exs) == 10
    assert task.prompt(exs[1]) == "Q: question 1\nA:"
    with pytest.raises(FileNotFoundError):
        get_task(str(tmp_path / "missing.jsonl"), template="{question}")


# --- local files: strict validation ------------------------------------------------------------

GOOD = {"id": "a", "question": "q?", "passage": None, "choices": ["x", "y"], "label": 1}


def test_load_local_good(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"question": "p", "choices": ["u"], "label": 0}])
    exs = load_local(f)
    assert exs[0] == Example(question="q?", choices=("x", "y"), label=1, passage=None, id="a")
    assert exs[1].id == "d-2" and exs[1].passage is None  # id and passage are optional


BAD_LINES = [
    ("", "empty line"),
    ("   ", "empty line"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "label"}), "missing field"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "choices"}), "missing field"),
    (json.dumps(GOOD | {"label": "1"}), "'label' must be an integer"),
    (json.dumps(GOOD | {"label": True}), "'label' must be an integer"),
    (json.dumps(GOOD | {"label": 1.0}), "'label' must be an integer"),
    (json.dumps(GOOD | {"label": 2}), "label 2 out of range"),
    (json.dumps(GOOD | {"label": -1}), "label -1 out of range"),
    (json.dumps(GOOD | {"question": 3}), "'question' must be a string"),
    (json.dumps(GOOD | {"question": " "}), "'question' is empty"),
    (json.dumps(GOOD | {"passage": ["p"]}), "'passage' must be a string or null"),
    (json.dumps(GOOD | {"choices": "x y"}), "'choices' must be a list"),
    (json.dumps(GOOD | {"choices": []}), "'choices' is empty"),
    (json.dumps(GOOD | {"choices": ["x", 2]}), r"choices\[1\] must be a string"),
    (json.dumps(GOOD | {"choices": ["x", ""]}), r"choices\[1\] is empty"),
    (json.dumps(GOOD | {"id": 7}), "'id' must be a string"),
    (json.dumps(GOOD | {"answer": 1}), "unknown field"),
    (json.dumps(GOOD | {"id": "first"}), "duplicate id 'first' \\(first on line 1\\)"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    good = [json.dumps(GOOD | {"id": "first"}), json.dumps(GOOD | {"id": "second"})]
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([*good, line, json.dumps(GOOD | {"id": "last"})]) + "\n")
    with pytest.raises(DataError, match=message) as err:
        load_local(f)
    assert err.value.line == 3 and err.value.path == str(f)
    assert f"{f}:3:" in str(err.value)


def test_bad_encoding_and_empty_file(tmp_path):
    f = tmp_path / "latin.jsonl"
    f.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"question": "caf\xe9"}\n')
    with pytest.raises(DataError, match="UTF-8") as err:
        load_local(f)
    assert err.value.line == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty") as err:
        load_local(empty)
    assert str(empty) in str(err.value)
    with pytest.raises(FileNotFoundError):
        load_local(tmp_path / "nope.jsonl")


def test_trailing_blank_lines_are_accepted_and_a_blank_line_between_items_is_an_error(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n")
    assert load_local(f) == load_local(write_jsonl(tmp_path / "u.jsonl", [GOOD]))
    f.write_text(json.dumps(GOOD) + "\r\n  \n\n")  # CRLF, whitespace-only: blank too
    assert len(load_local(f)) == 1
    f.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "id": "other"}) + "\n")
    with pytest.raises(DataError, match="empty line") as err:
        load_local(f)
    assert err.value.line == 2


def test_a_bad_line_in_a_task_folder_surfaces_through_load_splits(tmp_path):
    write_jsonl(tmp_path / "sst2" / "train.jsonl", rows(20))
    write_jsonl(tmp_path / "sst2" / "validation.jsonl", [*rows(4, "v"), '{"question": 1}'])
    with pytest.raises(DataError, match=r"validation\.jsonl:5:"):
        load_splits("sst2", n_train=2, n_heldout=2, data_dir=tmp_path)


# --- hub mapping -------------------------------------------------------------------------------

HUB_FIXTURES = {
    # task: (hub row, local line, local split, row index)
    "sst2": (
        {"sentence": "it 's a charming and often affecting journey . ", "label": 1, "idx": 0},
        {
            "id": "sst2-validation-0",
            "question": "it 's a charming and often affecting journey . ",
            "passage": None,
            "choices": ["negative", "positive"],
            "label": 1,
        },
        "validation",
        0,
    ),
    "boolq": (
        {
            "question": "does ethanol take more energy make that produces",
            "answer": False,
            "passage": "All biomass goes through at least some of these steps.",
        },
        {
            "id": "boolq-validation-0",
            "question": "does ethanol take more energy make that produces",
            "passage": "All biomass goes through at least some of these steps.",
            "choices": ["no", "yes"],
            "label": 0,
        },
        "validation",
        0,
    ),
    "arc_easy": (
        {
            "id": "MCAS_2000_4_6",
            "question": "Which technology was developed most recently?",
            "choices": {
                "text": ["cellular telephone", "television", "refrigerator", "airplane"],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": "A",
        },
        {
            "id": "MCAS_2000_4_6",
            "question": "Which technology was developed most recently?",
            "passage": None,
            "choices": ["cellular telephone", "television", "refrigerator", "airplane"],
            "label": 0,
        },
        "validation",
        0,
    ),
    "arc_challenge": (
        {
            "id": "Q-1",
            "question": "Pick two?",
            "choices": {"text": ["one", "two", "three"], "label": ["1", "2", "3"]},
            "answerKey": "2",
        },
        {
            "id": "Q-1",
            "question": "Pick two?",
            "passage": None,
            "choices": ["one", "two", "three"],
            "label": 1,
        },
        "train",
        5,
    ),
    "obqa": (
        {
            "id": "7-57",
            "question_stem": "Gas can fill any container it is given, and liquid",
            "choices": {
                "text": [
                    "is standard weight and size",
                    "is the opposite of variable",
                    "only needs a few",
                    "uses what it needs",
                ],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": "D",
        },
        {
            "id": "7-57",
            "question": "Gas can fill any container it is given, and liquid",
            "passage": None,
            "choices": [
                "is standard weight and size",
                "is the opposite of variable",
                "only needs a few",
                "uses what it needs",
            ],
            "label": 3,
        },
        "validation",
        1,
    ),
    "hellaswag": (  # a WikiHow item: the markup is removed as in shared/data
        {
            "ind": 4,
            "activity_label": "Personal Care and Style",
            "ctx_a": "[header] How to become a fashion consultant [title] Obtain your ged.",
            "ctx_b": "",
            "ctx": "[header] How to become a fashion consultant [title] Obtain your "
            "ged. [step] This job requires a diploma.",
            "endings": [
                "Many schools have classes in your field. [title] Search for positions.",
                "[substeps] Earn a degree.",
                "Go  home.",
                "[title] Stay.",
            ],
            "source_id": "wikihow~1",
            "split": "val",
            "split_type": "indomain",
            "label": "1",
        },
        {
            "id": "hellaswag-validation-3243",
            "question": "How to become a fashion consultant. Obtain your ged. This job requires a diploma.",
            "passage": None,
            "choices": [
                "Many schools have classes in your field.. Search for positions.",
                "Earn a degree.",
                "Go home.",
                "Stay.",
            ],
            "label": 1,
        },
        "validation",
        3243,
    ),
}


@pytest.mark.parametrize("name", sorted(HUB_FIXTURES))
def test_hub_mapping_equals_local_schema(tmp_path, name):
    hub_row, local_line, split, index = HUB_FIXTURES[name]
    local = load_local(write_jsonl(tmp_path / f"{split}.jsonl", [local_line]))[0]
    assert hub_row_to_example(name, hub_row, split=split, index=index) == local


@needs_shared
def test_hub_mapping_matches_the_real_local_copy():
    """The ActivityNet HellaSwag row 0 and ARC/SST-2 rows 0 as the hub gives them."""
    hs = load_local(SHARED / "hellaswag" / "validation.jsonl")[0]
    row = {
        "activity_label": "Roof shingle removal",
        "ctx": "A man is sitting on a roof. he",
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "label": "3",
    }
    assert hub_row_to_example("hellaswag", row, "validation", 0) == hs
    sst = load_local(SHARED / "sst2" / "validation.jsonl")[0]
    assert hub_row_to_example("sst2", HUB_FIXTURES["sst2"][0], "validation", 0) == sst
    arc = load_local(SHARED / "arc_easy" / "validation.jsonl")[0]
    assert hub_row_to_example("arc_easy", HUB_FIXTURES["arc_easy"][0]) == arc


def test_hellaswag_clean():
    assert hellaswag_clean("[header] How to x [title] Do y. [step] Then z.") == ("How to x. Do y. Then z.")
    assert hellaswag_clean("keeps [other] brackets") == "keeps [other] brackets"
    assert hellaswag_clean("A  B") == "A B"


def test_hub_mapping_errors():
    with pytest.raises(ValueError, match="answerKey"):
        hub_row_to_example("arc_easy", HUB_FIXTURES["arc_easy"][0] | {"answerKey": "E"})
    with pytest.raises(ValueError, match="unlabelled"):
        hub_row_to_example("hellaswag", HUB_FIXTURES["hellaswag"][0] | {"label": ""})
    with pytest.raises(ValueError, match="no hub mapping"):
        hub_row_to_example("mine", {})


def test_a_task_is_one_record(monkeypatch):
    """Template, local and hub sources, the hub row mapping and the grouping live on the Task."""
    from loca.data import HubSpec, Task
    from loca.data.sources import has_split
    from loca.data.tasks import CONTEXT, PASSAGE

    assert TASKS["boolq"].group_by is PASSAGE and TASKS["hellaswag"].group_by is CONTEXT
    assert TASKS["boolq"].describe()["group_by"] == "passage" and TASKS["sst2"].group_name is None
    assert replace(TASKS["sst2"], group_by="context").group_by is CONTEXT  # a grouping by name
    monkeypatch.delenv("LOCA_DATA_DIR", raising=False)

    def row_to_item(row, split, index):
        return Example(question=row["q"], choices=("a", "b"), label=0, id=f"mine-{split}-{index}")

    mine = Task(name="mine", template="{question}", hub=HubSpec("me/mine", to_example=row_to_item))
    assert hub_row_to_example(mine, {"q": "x"}, "validation", 3) == row_to_item({"q": "x"}, "validation", 3)
    assert has_split(mine, "train") and has_split(mine, "validation")
    assert not has_split(replace(mine, hub=replace(mine.hub, train_split=None)), "train")


def test_offline_without_local_data_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("LOCA_DATA_DIR", raising=False)
    task = get_task("arc_challenge")
    with pytest.raises(DataNotFoundError) as err:
        load_task_split(task, "validation", data_dir=tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "arc_challenge") in msg and "allenai/ai2_arc" in msg
    assert "HF_HUB_OFFLINE" in msg or "datasets" in msg
    # no data dir at all
    with pytest.raises(DataNotFoundError, match="neither data_dir nor \\$LOCA_DATA_DIR"):
        load_task_split(task, "validation")


def test_missing_datasets_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataNotFoundError, match="datasets"):
        load_task_split(get_task("sst2"), "validation", data_dir=tmp_path)


def test_hub_path_maps_rows_and_falls_back_to_parquet(monkeypatch):
    """A stand-in ``datasets`` module: the first call fails as datasets >= 4 does for a repo with
    a loading script; the parquet export is then used and its rows mapped."""
    import types

    calls = []

    def load_dataset(path, name=None, split=None, revision=None):
        calls.append((path, name, split, revision))
        if revision is None:
            raise RuntimeError("Dataset scripts are no longer supported, but found hellaswag.py")
        return [HUB_FIXTURES["hellaswag"][0]] * 2

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("LOCA_DATA_DIR", raising=False)
    exs = load_task_split(get_task("hellaswag"), "validation")
    assert calls == [
        ("Rowan/hellaswag", None, "validation", None),
        ("Rowan/hellaswag", None, "validation", "refs/convert/parquet"),
    ]
    assert [e.id for e in exs] == ["hellaswag-validation-0", "hellaswag-validation-1"]
    assert exs[0].choices[0] == "Many schools have classes in your field.. Search for positions."


def test_local_folder_missing_split_lists_present(tmp_path):
    write_jsonl(tmp_path / "obqa" / "validation.jsonl", rows(3))
    with pytest.raises(DataNotFoundError, match="splits present .*: validation"):
        load_task_split(get_task("obqa"), "test", data_dir=tmp_path)


def test_data_dir_from_environment(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "obqa" / "validation.jsonl", rows(3))
    monkeypatch.setenv("LOCA_DATA_DIR", str(tmp_path))
    assert len(load_task_split(get_task("obqa"), "validation")) == 3


# --- splits ------------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path):
    write_jsonl(tmp_path / "sst2" / "train.jsonl", rows(100, "tr"))
    write_jsonl(tmp_path / "sst2" / "validation.jsonl", rows(30, "va"))
    write_jsonl(
        tmp_path / "boolq" / "validation.jsonl",
        [r | {"passage": f"passage {i}"} for i, r in enumerate(rows(41, "bq"))],
    )
    return tmp_path


def test_permutation_is_stable():
    assert permutation(5, 0, "pool") == permutation(5, 0, "pool")
    assert sorted(permutation(50, 3, "x")) == list(range(50))
    assert permutation(50, 0, "x") != permutation(50, 1, "x")
    assert permutation(6, 0, "pool") == [3, 5, 0, 4, 2, 1]  # pinned: changes break old runs


def test_splits_deterministic_disjoint_recorded(data_dir):
    a = load_splits("sst2", n_train=20, n_heldout=10, n_test=12, seed=1, data_dir=data_dir)
    b = load_splits("sst2", n_train=20, n_heldout=10, n_test=12, seed=1, data_dir=data_dir)
    c = load_splits("sst2", n_train=20, n_heldout=10, n_test=12, seed=2, data_dir=data_dir)
    assert a.train == b.train and a.heldout == b.heldout and a.test == b.test
    assert a.record == b.record
    assert [e.id for e in a.train] != [e.id for e in c.train]
    ids_train, ids_held = {e.id for e in a.train}, {e.id for e in a.heldout}
    assert len(ids_train) == 20 and len(ids_held) == 10 and not ids_train & ids_held
    assert all(i.startswith("tr-") for i in ids_train | ids_held)
    assert len(a.test) == 12 and all(e.id.startswith("va-") for e in a.test)
    r = a.record
    assert r["seed"] == 1 and r["partition"] is None
    assert r["pool"] == {"split": "train", "size": 100, "group_by": None, "n_groups": None}
    assert r["train"]["ids"] == [e.id for e in a.train]
    assert r["heldout"]["ids"] == [e.id for e in a.heldout]
    assert r["test"]["ids"] == [e.id for e in a.test]
    assert [f"tr-{i}" for i in r["train"]["indices"]] == r["train"]["ids"]
    assert r["test"]["indices"] == sorted(r["test"]["indices"])  # test kept in file order
    assert r["source"] == {"kind": "local", "folder": str(data_dir / "sst2")}
    json.dumps(r)  # JSON-friendly


def test_heldout_independent_of_n_train_and_train_nested(data_dir):
    small = load_splits("sst2", n_train=10, n_heldout=10, seed=0, data_dir=data_dir)
    big = load_splits("sst2", n_train=40, n_heldout=10, seed=0, data_dir=data_dir)
    assert small.heldout == big.heldout
    assert big.train[:10] == small.train


def test_test_set_matches_load_test_and_defaults_to_all(data_dir):
    s = load_splits("sst2", n_train=5, n_heldout=5, n_test=7, seed=3, data_dir=data_dir)
    test, record = load_test("sst2", n_test=7, seed=3, data_dir=data_dir)
    assert test == s.test and record["test"] == s.record["test"]
    for n in (None, 0):
        assert len(load_test("sst2", n_test=n, data_dir=data_dir)[0]) == 30


def test_partition_when_no_train_split(data_dir):
    s = load_splits("boolq", n_train=8, n_heldout=4, seed=0, data_dir=data_dir)
    part = s.record["partition"]
    assert part["seed"] == 0 and part["pool_size"] + part["test_size"] == 41
    assert part["test_size"] == round(41 * 0.5)
    test_ids = {e.id for e in s.test}
    assert len(s.test) == part["test_size"]
    assert not test_ids & {e.id for e in s.train + s.heldout}
    # the partition does not depend on the run's seed or sizes
    s2 = load_splits("boolq", n_train=3, n_heldout=2, seed=9, data_dir=data_dir)
    assert {e.id for e in s2.test} == test_ids
    # indices point into the validation file
    val = load_local(data_dir / "boolq" / "validation.jsonl")
    assert [val[i].id for i in s.record["train"]["indices"]] == s.record["train"]["ids"]
    assert [val[i].id for i in s.record["test"]["indices"]] == s.record["test"]["ids"]


def test_user_file_is_partitioned(tmp_path):
    f = write_jsonl(tmp_path / "mine.jsonl", rows(20))
    task = get_task(str(f), template="{question}")
    s = load_splits(task, n_train=4, n_heldout=2, seed=0)
    assert len(s.test) == 10 and s.record["partition"] is not None
    assert s.record["source"]["kind"] == "local"


def test_split_errors(data_dir):
    with pytest.raises(ValueError, match="exceeds the train pool \\(100"):
        load_splits("sst2", n_train=95, n_heldout=10, data_dir=data_dir)
    with pytest.raises(ValueError, match="non-test part"):
        load_splits("boolq", n_train=20, n_heldout=10, data_dir=data_dir)
    with pytest.raises(ValueError, match="n_test=31 exceeds the 30"):
        load_splits("sst2", n_train=5, n_heldout=5, n_test=31, data_dir=data_dir)
    with pytest.raises(ValueError, match="at least 1"):
        load_splits("sst2", n_train=0, n_heldout=5, data_dir=data_dir)
    with pytest.raises(ValueError, match="at least 1"):
        load_splits("sst2", n_train=5, n_heldout=0, data_dir=data_dir)
    with pytest.raises(ValueError, match="non-negative"):
        load_test("sst2", n_test=-1, data_dir=data_dir)


def test_too_small_to_partition(tmp_path):
    f = write_jsonl(tmp_path / "one.jsonl", rows(1))
    with pytest.raises(ValueError, match="too few to partition"):
        load_splits(get_task(str(f), template="{question}"), n_train=1, n_heldout=1)


@needs_shared
def test_real_local_data_counts_and_policy():
    sst2 = load_task_split(get_task("sst2"), "validation", data_dir=SHARED)
    assert len(sst2) == 872 and sum(e.label for e in sst2) == 444
    test, record = load_test("sst2", data_dir=SHARED)
    assert len(test) == 872 and record["partition"] is None
    test, record = load_test("boolq", n_test=100, seed=0, data_dir=SHARED)
    assert len(test) == 100 and record["partition"]["pool_size"] == 1634
    assert record["test"]["available"] == 1636


# --- grouped partitions ------------------------------------------------------------------------


def grouped_rows(n_passages: int, sizes=(1, 2, 3)) -> list[dict]:
    """Items over ``n_passages`` passages, passage p asked about ``sizes[p % len(sizes)]`` times."""
    out = []
    for p in range(n_passages):
        for q in range(sizes[p % len(sizes)]):
            out.append(
                {
                    "id": f"p{p}-q{q}",
                    "question": f"question {q} about {p}",
                    "passage": f"Passage number {p} has one sentence of some length.",
                    "choices": ["no", "yes"],
                    "label": (p + q) % 2,
                }
            )
    return out


def grouped_task(path: Path):
    return replace(get_task(str(path), template="{passage}\nQ: {question}?\nA:"), group_by="passage")


def test_group_ids_link_transitively_and_number_by_first_item():
    ex = lambda q, p: Example(question=q, passage=p, choices=("no", "yes"), label=0)  # noqa: E731
    exs = [
        ex("a", "One two three four five. Six seven eight nine ten."),
        ex("b", "Something else entirely, not shared at all."),
        ex("c", "Eleven twelve thirteen fourteen. Six seven eight nine ten!"),  # shares a sentence
        ex("d", "Eleven twelve thirteen fourteen fifteen."),  # shares nothing
        ex("e", "something   else, ENTIRELY not shared at all"),  # b up to case/punctuation
        ex("f", "Hi."),  # short: only its whole text links
        ex("g", "hi"),
    ]
    task = replace(get_task("boolq"), group_by="passage")
    assert group_ids(task, exs) == [0, 1, 0, 2, 1, 3, 3]
    assert group_ids(replace(task, group_by=None), exs) is None
    with pytest.raises(ValueError, match="unknown group_by 'nope'"):
        replace(task, group_by="nope")


def test_context_keys_link_the_next_window_of_a_video():
    # shared/data hellaswag items 3 and 4: item 4's context holds item 3's completed gold sentence
    a = Example(
        question="A boy is running down a track. the boy",
        label=2,
        choices=(
            "runs into a car.",
            "gets in a mat.",
            "lifts his body above the height of a pole.",
            "stands on his hands.",
        ),
    )
    b = Example(
        question="The boy lifts his body above the height of a pole. The boy lands on his "
        "back on to a red mat. the boy",
        choices=("x", "y"),
        label=0,
    )
    assert context_keys(a) & context_keys(b) == {"the boy lifts his body above the height of a pole"}
    assert group_ids(get_task("hellaswag"), [a, b]) == [0, 0]
    assert not passage_keys(a)  # no passage: never linked by passage


def test_grouped_partition_keeps_passages_whole(tmp_path):
    f = write_jsonl(tmp_path / "mine.jsonl", grouped_rows(30))  # 60 items in 30 groups of 1-3
    task = grouped_task(f)
    pool, test, part = load_pool(task)
    assert shared_with(test, pool, lambda e: {e.passage}) == 0
    assert {e.passage for e in test}.isdisjoint(e.passage for e in pool)
    assert len(pool) + len(test) == 60 and 30 <= len(test) <= 30 + 2  # overshoot < largest group
    assert part["group_by"] == "passage" and part["n_groups"] == 30
    assert part["pool_groups"] + part["test_groups"] == 30
    assert part["test_size"] == len(test) and part["pool_size"] == len(pool)
    json.dumps(part)
    # the same whole-group rule as the item partition: groups permuted with the partition seed
    order = permutation(30, 0, "partition")
    taken, n = [], 0
    for g in order:
        if n >= 30:
            break
        taken.append(g)
        n += (1, 2, 3)[g % 3]
    assert {e.passage for e in test} == {grouped_rows(30)[0]["passage"].replace("0", str(g)) for g in taken}
    # deterministic and independent of the run's seed and sizes
    s1 = load_splits(task, n_train=6, n_heldout=4, seed=0)
    s2 = load_splits(task, n_train=3, n_heldout=2, seed=7)
    assert s1.test == s2.test == test and s1 == load_splits(task, n_train=6, n_heldout=4, seed=0)
    assert s1.record["pool"] == {
        "split": "mine",
        "size": len(pool),
        "group_by": "passage",
        "n_groups": part["pool_groups"],
    }


def test_ungrouped_partition_is_the_item_partition(tmp_path):
    f = write_jsonl(tmp_path / "mine.jsonl", grouped_rows(30))
    plain = get_task(str(f), template="{passage}\nQ: {question}?\nA:")
    _, test, part = load_pool(plain)
    val = load_local(f)
    assert [e.id for e in test] == [val[i].id for i in sorted(permutation(60, 0, "partition")[:30])]
    assert part["group_by"] is None and part["n_groups"] is None
    # a grouping in which every item is alone gives exactly the same partition
    distinct = write_jsonl(
        tmp_path / "distinct.jsonl", [r | {"passage": f"{r['id']} passage"} for r in grouped_rows(30)]
    )
    _, test_g, part_g = load_pool(grouped_task(distinct))
    assert [e.id for e in test_g] == [e.id for e in test] and part_g["n_groups"] == 60


def test_grouped_train_and_heldout_share_no_group(tmp_path):
    f = write_jsonl(tmp_path / "mine.jsonl", grouped_rows(60))  # 120 items
    task = grouped_task(f)
    for seed in range(5):
        s = load_splits(task, n_train=30, n_heldout=15, seed=seed)
        assert len(s.train) == 30 and len(s.heldout) == 15
        train_p, held_p = {e.passage for e in s.train}, {e.passage for e in s.heldout}
        assert not train_p & held_p and not (train_p | held_p) & {e.passage for e in s.test}
        small = load_splits(task, n_train=10, n_heldout=15, seed=seed)
        assert small.heldout == s.heldout and s.train[:10] == small.train  # nested, held-out fixed
    pool_size, outcomes = s.record["pool"]["size"], set()
    for seed in range(10):  # held-out often starts inside a group: the rest of it is not trained on
        try:
            load_splits(task, n_train=pool_size - 15, n_heldout=15, seed=seed)
            outcomes.add("fits")
        except ValueError as exc:
            assert "share no 'passage' group with the 15 held-out" in str(exc)
            outcomes.add("cut")
    assert "cut" in outcomes


@needs_shared
def test_real_boolq_and_hellaswag_partitions_share_no_passage_or_context():
    boolq = get_task("boolq")
    pool, test, part = load_pool(boolq, SHARED)
    assert shared_with(test, pool, lambda e: {e.passage}) == 0
    assert shared_with(test, pool, passage_keys) == 0
    assert (len(pool), len(test)) == (1634, 1636) and abs(len(test) - 3270 / 2) <= 9
    assert part["group_by"] == "passage" and part["n_groups"] == 2890
    assert part["pool_groups"] + part["test_groups"] == 2890
    # the item partition (before grouping) put 186 test items on a passage of the pool
    old_pool, old_test, _ = load_pool(replace(boolq, group_by=None), SHARED)
    assert shared_with(old_test, old_pool, lambda e: {e.passage}) == 186
    assert load_pool(boolq, SHARED) == (pool, test, part)
    s = load_splits(boolq, n_train=256, n_heldout=128, n_test=200, seed=0, data_dir=SHARED)
    assert not {e.passage for e in s.train} & {e.passage for e in s.heldout}
    pool, test, part = load_pool("hellaswag", SHARED)
    assert shared_with(test, pool, lambda e: {e.question}) == 0
    assert shared_with(test, pool, context_keys) == 0
    assert len(test) == 5021 and part["group_by"] == "context" and part["n_groups"] == 8785


# --- tokenisation ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_encode_examples_gold_and_eos(tok):
    task = get_task("sst2")
    ex = Example(question="a charming journey . ", choices=("negative", "positive"), label=1)
    enc = encode_examples(tok, task, [ex, ex], max_length=64, add_eos=True)
    assert enc[0].completion == (tok.convert_tokens_to_ids("positive"), tok.eos_token_id)
    assert enc[0].has_eos and enc[1].source == 1 and enc[0].choice == 1
    assert enc[0].n_chars == len("positive")
    assert tok.decode(list(enc[0].prompt)).startswith("Review")
    no_eos = encode_examples(tok, task, [ex], max_length=64, add_eos=False)[0]
    assert no_eos.completion == (tok.convert_tokens_to_ids("positive"),) and not no_eos.has_eos


def test_truncation_never_removes_answer_tokens(tok):
    task = get_task("arc_easy")
    long_q = " ".join(["the"] * 100) + " Which technology was developed most recently?"
    ex = Example(question=long_q, choices=("cellular telephone", "a b c d e f g h"), label=1)
    full_prompt = tok(task.prompt(ex))["input_ids"]
    for max_length in (12, 20, 64):
        gold = encode_examples(tok, task, [ex], max_length=max_length, add_eos=True)[0]
        answer = tok(" a b c d e f g h", add_special_tokens=False)["input_ids"]
        assert list(gold.completion) == [*answer, tok.eos_token_id]
        assert len(gold.ids) <= max_length and len(gold.prompt) >= 1
        assert list(gold.prompt) == full_prompt[-len(gold.prompt) :]  # cut from the left
        choices = encode_choices(tok, task, [ex], max_length=max_length)
        assert [c.choice for c in choices] == [0, 1]
        assert all(len(c.ids) <= max_length for c in choices)
        assert choices[0].prompt == choices[1].prompt  # same context for every choice
        assert list(choices[1].completion) == answer and not choices[1].has_eos
        assert choices[0].n_chars == len("cellular telephone")
        with_eos = encode_choices(tok, task, [ex], max_length=max_length, eos_on_gold=True)
        assert with_eos[0].prompt == with_eos[1].prompt and len(with_eos[1].ids) <= max_length
        assert list(with_eos[1].completion) == [*answer, tok.eos_token_id]
        assert with_eos[1].has_eos and not with_eos[0].has_eos


def test_encode_choices_layout(tok):
    task = get_task("arc_easy")
    exs = [TASKS["arc_easy"].sample, Example(question="Question x", choices=("yes", "no"), label=1)]
    enc = encode_choices(tok, task, exs, max_length=64)
    assert [(e.source, e.choice) for e in enc] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert [e.n_chars for e in enc] == [18, 10, 12, 8, 3, 2]


def test_left_truncation_keeps_a_leading_bos():
    from loca.data.batching import truncate_prompt

    assert truncate_prompt([1, 5, 6, 7, 8], 3, bos_id=1) == (1, 7, 8)
    assert truncate_prompt([5, 6, 7, 8], 3, bos_id=1) == (6, 7, 8)
    assert truncate_prompt([1, 5, 6], 5, bos_id=1) == (1, 5, 6)
    assert truncate_prompt([1, 5, 6, 7], 1, bos_id=1) == (7,)
