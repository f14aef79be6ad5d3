"""The clients people already use, unchanged, against one float32 head + tail: lm-evaluation-harness's
local-completions, its numbers against lm-eval's own `hf` backend on the same weights."""

from pathlib import Path

import pytest

from helpers import MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.processes]

TASKS = Path(__file__).parent / "eval_tasks"  # lm-eval task YAMLs and their local dataset


@pytest.fixture(scope="module")
def base_url(mesh):
    return f"{mesh.head.url}/v1"


def _evaluate(model, model_args):
    """lm-eval's Python API on the two local tasks; each task's logged samples by doc_id."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)  # (indexing lm-eval's own: seconds)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["meshws_choice", "meshws_generate"],
                                  task_manager=tasks, log_samples=True)
    return {task: {sample["doc_id"]: sample["resps"] for sample in samples}
            for task, samples in out["samples"].items()}


def test_lm_evaluation_harness_scores_and_generates_as_its_own_hf_backend(base_url, embedded_model,
                                                                          embedded_folder, monkeypatch):
    """`local-completions` with its default arguments (token-id prompts, batch size 1) against the head, and
    lm-eval's `hf` backend on the same float32 weights, offline: every choice's loglikelihood within 1e-4, the
    same is-greedy flags, the same greedy generations."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS)  # the tasks' data_files
    served = _evaluate("local-completions", {"base_url": f"{base_url}/completions", "model": MODEL,
                                             "tokenizer": str(embedded_model.folder)})
    reference = _evaluate("hf", {"pretrained": str(embedded_folder.folder), "dtype": "float32", "device": "cpu"})

    documents = len((TASKS / "questions.jsonl").read_text().splitlines())
    choices, want = served["meshws_choice"], reference["meshws_choice"]
    assert sorted(choices) == sorted(want) == list(range(documents))
    differences = []
    for doc_id, responses in want.items():
        assert len(choices[doc_id]) == len(responses) == 3
        for (got_score, got_greedy), (want_score, want_greedy) in zip((r[0] for r in choices[doc_id]),
                                                                      (r[0] for r in responses)):
            differences.append(abs(got_score - want_score))
            assert got_greedy == want_greedy
    assert max(differences) < 1e-4, f"largest loglikelihood difference {max(differences):.2e}"

    generations = {doc_id: responses[0][0] for doc_id, responses in served["meshws_generate"].items()}
    assert generations == {doc_id: responses[0][0] for doc_id, responses in reference["meshws_generate"].items()}
    assert len(generations) == documents and all(generations.values())
