"""Data: the built-in arithmetic task and JSONL loaders."""

from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, make_question, probe_set, test_set
from grpolab.data.jsonl import DataError, ListSampler, load_gsm8k_jsonl

__all__ = [
    "ArithmeticSpec",
    "DataError",
    "ListSampler",
    "TrainSampler",
    "load_gsm8k_jsonl",
    "make_question",
    "probe_set",
    "test_set",
]
