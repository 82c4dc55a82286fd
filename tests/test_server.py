"""The OpenAI-compatible server on loopback, driven by a real HTTP client (one server per module)."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from tests.conftest import EMBEDDED


@pytest.fixture(scope="module")
def server():
    from onecat.engine.server.app import ServeConfig, ServerState
    from onecat.engine.server.launch import start_in_thread

    state = ServerState.create(ServeConfig(model=EMBEDDED, served_model_name=["smol"], max_model_len=1024,
                                           max_num_seqs=16, max_queue_len=64))
    srv = start_in_thread(state)
    yield srv
    srv.stop()
    state.llm.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client, content="Say hello.", **kw):
    body = {"model": "smol", "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_idle(server, timeout=20.0) -> int:
    """Free KV blocks once no request is in flight (the engine thread finishes aborts asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.state.engine.num_in_flight == 0:
            free = server.state.engine.run_sync(lambda llm: (llm.engine.blocks.num_free_blocks,
                                                             llm.engine.has_unfinished()))
            if not free[1]:
                return free[0]
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {server.state.engine.num_in_flight}")


def all_blocks(server) -> int:
    return server.state.llm.engine.blocks.num_blocks - 1  # block 0 is the reserved null block


def metric(client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------- surface
def test_models_and_health(client, server, monkeypatch):
    assert client.get("/health").status_code == 200
    # an engine that can no longer step (e.g. a dead tensor-parallel rank) fails the probe, with why
    monkeypatch.setattr(server.state.engine.llm, "down_reason", lambda: "tensor-parallel rank 1 is not running")
    down = client.get("/health")
    assert down.status_code == 503 and "rank 1 is not running; restart the server" in down.json()["error"]["message"]
    monkeypatch.undo()
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smol"]
    assert data[0]["max_model_len"] == 1024


def test_chat_completion_shape_and_usage(client):
    r = chat(client)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 12
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_streaming_matches_non_streaming_and_reports_usage(client):
    whole = chat(client, max_tokens=24).json()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_stop_string_cut_the_same_streamed_and_not(client):
    base = chat(client, max_tokens=16).json()["choices"][0]["message"]["content"]
    words = base.split()
    assert len(words) >= 3
    stop = " " + words[2]
    whole = chat(client, max_tokens=16, stop=[stop]).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and stop not in whole["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0, "stream": True, "stop": [stop]}) as r:
        events = sse_events(r)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1] if c["choices"])
    assert text == whole["message"]["content"]


def test_seeded_sampling_is_reproducible_and_n_gives_choices(client):
    a = chat(client, temperature=1.0, seed=7, n=2, max_tokens=10).json()
    b = chat(client, temperature=1.0, seed=7, n=2, max_tokens=10).json()
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]


def test_chat_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=5).json()
    items = r["choices"][0]["logprobs"]["content"]
    assert len(items) == r["usage"]["completion_tokens"]
    for it in items:
        assert it["logprob"] <= 0 and len(it["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert it["logprob"] == pytest.approx(max(t["logprob"] for t in it["top_logprobs"]), abs=1e-5)


def test_completion_echo_logprobs_match_engine_scores(client, server):
    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1, "echo": True,
                                             "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    scores = server.state.engine.run_sync(lambda llm: llm.score([prompt])[0])
    n = len(scores.prompt_token_ids)
    assert len(lp["tokens"]) == n + 1 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(scores.logprobs, abs=1e-4)
    assert "".join(lp["tokens"]) == choice["text"]


def test_echo_top_logprobs_hold_the_likeliest_tokens_of_each_prompt_position(client, server):
    """lm-eval reads "is greedy" off top_logprobs under echo: each prompt position must list the
    likeliest tokens there (the engine's own next-token top-k for that prefix), not only the prompt's
    token, which made every position look greedy."""
    from onecat.engine import SamplingParams

    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = server.state.engine.run_sync(lambda llm: llm.score([prompt])[0]).prompt_token_ids
    tok = server.state.tokenizer
    greedy = []
    for i in range(1, len(ids)):
        want = server.state.engine.run_sync(lambda llm: llm.generate(
            [ids[:i]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))[0].logprobs[0])
        best = sorted(want.items(), key=lambda kv: -kv[1])[:2]
        top = list(lp["top_logprobs"][i].items())
        assert [t for t, _ in top[:2]] == [tok.decode([t], skip_special_tokens=False) for t, _ in best]
        assert [v for _, v in top[:2]] == pytest.approx([v for _, v in best], abs=1e-4)
        assert lp["top_logprobs"][i][lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
        greedy.append(top[0][0] == lp["tokens"][i])
    assert any(greedy) and not all(greedy)


def test_prompt_logprobs_in_vllm_shape_and_refused_when_streamed(client, server):
    prompt = "The capital of France is Paris."
    r = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1,
                                             "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = server.state.engine.run_sync(lambda llm: llm.score([prompt])[0]).prompt_token_ids
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        own = entry[str(tid)]
        ranked = sorted((e for e in entry.values()), key=lambda e: e["rank"])
        assert {e["rank"] for e in entry.values()} >= {1, 2, 3} and own["rank"] >= 1
        assert ranked[0]["logprob"] >= own["logprob"]
        assert own["rank"] == 1 or own["logprob"] < ranked[0]["logprob"]  # rank 1: nothing likelier
    r = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1,
                                             "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs" in r.text


def test_tokenizer_info_serves_a_remote_tokenizer(client, server):
    """lm-eval's RemoteTokenizer: GET /tokenizer_info for eos/bos/pad and the chat template, then the eos
    id as the first id /tokenize gives for the eos text."""
    r = client.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    tok = server.state.tokenizer
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == server.state.max_model_len
    assert "eos_token" in info and "pad_token" in info and info["eos_token_ids"] == tok.eos_token_ids
    ids = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [tok.eos_token_ids[0]]


def test_completion_token_id_prompts_and_score_only(client):
    r = client.post("/v1/completions", json={"model": "smol", "prompt": [[504, 3575, 282], [504, 3575]],
                                             "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [3, 2]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "maximum context length"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                          "json_schema": {"name": "x"}}}, 400, "schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tools"),
])
def test_bad_requests_get_openai_errors(client, body, status, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = client.post("/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower()
    assert err["code"] == status and err["type"]


def test_prompt_too_long_is_400(client):
    r = client.post("/v1/completions", json={"prompt": "hello " * 2000, "max_tokens": 4})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_api_key(client, server):
    server.state.config.api_key = "sekret"
    try:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/health").status_code == 200  # health stays open for probes
    finally:
        server.state.config.api_key = None


def test_full_queue_answers_503(client, server):
    eng = server.state.engine
    saved = eng.max_in_flight
    eng.max_in_flight = 0
    try:
        r = chat(client)
        assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    finally:
        eng.max_in_flight = saved


def test_engine_error_fails_the_request_not_the_server(client, server):
    engine = server.state.llm.engine
    real_step = engine.step

    def broken_step():
        engine.step = real_step
        raise RuntimeError("injected failure")

    engine.step = broken_step
    r = chat(client)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert chat(client).status_code == 200
    assert wait_idle(server) == all_blocks(server)


# --------------------------------------------------------------------------- disconnects
def test_stream_disconnect_aborts_and_frees_kv_blocks(server):
    before = metric(httpx.Client(base_url=server.url), "vllm:request_success_total")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Write a long story about a cat."}],
                "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 4:
                    break  # leave with the request still generating
    assert wait_idle(server) == all_blocks(server)
    with httpx.Client(base_url=server.url) as c:
        text = c.get("/metrics").text
        assert metric(c, "vllm:request_success_total") == before + 1
    assert 'finished_reason="abort"' in text


def test_non_streaming_disconnect_aborts(server):
    with httpx.Client(base_url=server.url, timeout=0.8) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True})
    assert wait_idle(server) == all_blocks(server)


# --------------------------------------------------------------------------- structure
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_constrained_output_is_valid(client):
    r = chat(client, "Describe a person as JSON.", max_tokens=60, temperature=0.7, seed=3,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.post("/v1/chat/completions", json={
        "model": "smol", "messages": messages, "tools": [WEATHER], "max_tokens": 40, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21, "sky": "clear"}'}]
    r2 = client.post("/v1/chat/completions", json={"model": "smol", "messages": messages, "tools": [WEATHER],
                                                   "max_tokens": 20, "temperature": 0})
    assert r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["message"]["content"]


def test_required_tool_choice_streams_tool_calls(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 60, "temperature": 0, "stream": True}) as r:
        events = sse_events(r)
    last = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    calls = last["delta"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0


# --------------------------------------------------------------------------- metrics
def test_metrics_move_with_requests(client):
    names = ["vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count"]
    before = {n: metric(client, n) for n in names}
    assert chat(client, "Count to five.", max_tokens=8, ignore_eos=True).status_code == 200
    after = {n: metric(client, n) for n in names}
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 8
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 7
    text = client.get("/metrics").text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_queue_time_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in text, name


# --------------------------------------------------------------------------- speculative decoding
@pytest.fixture(scope="module")
def spec_server():
    from onecat.engine.server.app import ServeConfig, ServerState
    from onecat.engine.server.launch import start_in_thread

    state = ServerState.create(ServeConfig(model=EMBEDDED, max_model_len=1024, max_num_seqs=8,
                                           speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    srv = start_in_thread(state)
    yield srv
    srv.stop()
    state.llm.close()


def test_spec_decode_metrics_and_constrained_requests_under_speculation(spec_server):
    from onecat.gates.engines.openai_client import metrics_delta, parse_prometheus, spec_acceptance

    text = "one two three four five six seven eight nine ten " * 6
    with httpx.Client(base_url=spec_server.url, timeout=120) as c:
        before = parse_prometheus(c.get("/metrics").text)
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        spec = spec_acceptance(metrics_delta(before, parse_prometheus(c.get("/metrics").text)))
        assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"] > 0
        assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
        schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 12}}, "required": ["w"],
                  "additionalProperties": False}
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Answer in JSON: " + text}], "max_tokens": 30,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    assert wait_idle(spec_server) == all_blocks(spec_server)
