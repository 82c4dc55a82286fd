"""The results schema as an ordered list of migrations; a store is upgraded on open.

Version N of the schema is migrations[0..N-1] applied in order; `schema_version` holds N.
Add a migration by appending SQL to MIGRATIONS (never edit a released one).
JSON-valued columns are VARCHAR holding canonical JSON.
runs.status: running | interrupted | complete | failed ("lost" exists only in the run journal).
"""

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE runs (
        run_id VARCHAR PRIMARY KEY,
        contract_name VARCHAR NOT NULL,
        contract_fingerprint VARCHAR NOT NULL,
        contract_json VARCHAR NOT NULL,
        contract_path VARCHAR,
        baseline_fingerprint VARCHAR,
        candidate_fingerprint VARCHAR,
        arm_settings_json VARCHAR,
        dataset_sha256_json VARCHAR,
        engine_revision VARCHAR,
        harness_revision VARCHAR,
        onecat_version VARCHAR,
        status VARCHAR NOT NULL,          -- running | interrupted | complete | failed
        verdict VARCHAR,
        error VARCHAR,
        started_at TIMESTAMP NOT NULL,
        finished_at TIMESTAMP
    );
    CREATE TABLE environment (
        run_id VARCHAR NOT NULL,
        arm VARCHAR NOT NULL,
        hostname VARCHAR,
        platform VARCHAR,
        python_version VARCHAR,
        cpu_model VARCHAR,
        cpu_threads INTEGER,
        torch_threads INTEGER,
        gpu_name VARCHAR,
        gpu_count INTEGER,
        gpu_driver VARCHAR,
        torch_version VARCHAR,
        cuda_version VARCHAR,
        device VARCHAR,
        kv_cache_dtype VARCHAR,
        attention_backend VARCHAR,
        cuda_graph VARCHAR,
        prefix_caching VARCHAR,
        model_sha256 VARCHAR,
        engine_info_json VARCHAR,
        recorded_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, arm)
    );
    CREATE TABLE requests (
        run_id VARCHAR NOT NULL, arm VARCHAR NOT NULL, workload VARCHAR NOT NULL, request_key VARCHAR NOT NULL,
        unit_key VARCHAR, grp VARCHAR, seed BIGINT, repeat INTEGER, batch_size INTEGER,
        prompt_sha256 VARCHAR, num_prompt_tokens INTEGER, num_completion_tokens INTEGER, num_cached_tokens INTEGER,
        queue_s DOUBLE, prefill_s DOUBLE, ttft_s DOUBLE, decode_s DOUBLE, e2e_s DOUBLE, tpot_s DOUBLE,
        finish_reason VARCHAR, natural_stop_eligible BOOLEAN, natural_stop BOOLEAN, capped BOOLEAN,
        max_repeat_run INTEGER, repetition_loop BOOLEAN, replacement_chars INTEGER,
        token_sha256 VARCHAR, text_sha256 VARCHAR,
        spec_num_drafts BIGINT, spec_num_draft_tokens BIGINT, spec_num_accepted_tokens BIGINT,
        spec_accepted_per_position_json VARCHAR,
        error VARCHAR, extra_json VARCHAR, recorded_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, arm, workload, request_key)
    );
    CREATE TABLE item_outcomes (
        run_id VARCHAR NOT NULL, arm VARCHAR NOT NULL, workload VARCHAR NOT NULL,
        item_id VARCHAR NOT NULL, seed BIGINT NOT NULL, measure VARCHAR NOT NULL,
        passed BOOLEAN NOT NULL, failure_reason VARCHAR, extracted_answer VARCHAR,
        request_key VARCHAR, extra_json VARCHAR, recorded_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, arm, workload, item_id, seed, measure)
    );
    CREATE TABLE metrics (
        run_id VARCHAR NOT NULL, arm VARCHAR NOT NULL, workload VARCHAR NOT NULL, unit_key VARCHAR,
        name VARCHAR NOT NULL, mkey VARCHAR NOT NULL, value DOUBLE, unit VARCHAR NOT NULL,
        kind VARCHAR NOT NULL CHECK (kind IN ('measured', 'projected')),
        seed BIGINT, repeat INTEGER, position INTEGER, tags_json VARCHAR, recorded_at TIMESTAMP NOT NULL
    );
    CREATE TABLE units (
        run_id VARCHAR NOT NULL, arm VARCHAR NOT NULL, workload VARCHAR NOT NULL, unit_key VARCHAR NOT NULL,
        position INTEGER, finished_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, arm, workload, unit_key)
    );
    CREATE TABLE checks (
        run_id VARCHAR NOT NULL, gate_index INTEGER NOT NULL, gate_id VARCHAR NOT NULL, check_name VARCHAR NOT NULL,
        workload VARCHAR, status VARCHAR NOT NULL, informative BOOLEAN NOT NULL,
        summary VARCHAR, statistic_json VARCHAR, evidence_json VARCHAR, config_json VARCHAR,
        recorded_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, gate_index)
    );
    CREATE TABLE verdicts (
        run_id VARCHAR PRIMARY KEY, verdict VARCHAR NOT NULL, reason VARCHAR, recorded_at TIMESTAMP NOT NULL
    );
    """,
    # 2: who writes a run, so that a run whose writer was killed is noticed (liveness.py), and a count of
    # its status changes, so that the run journal can tell when the database lost some (journal.py)
    """
    ALTER TABLE runs ADD COLUMN writer_pid BIGINT;
    ALTER TABLE runs ADD COLUMN writer_host VARCHAR;
    ALTER TABLE runs ADD COLUMN writer_started VARCHAR;
    ALTER TABLE runs ADD COLUMN status_seq INTEGER DEFAULT 0;
    """,
    # 3: every column is named after its record field (results/records.py): `grp` was RequestRecord.group,
    # now `determinism_group`; `mkey` was Metric.key. Runs get a kind ("gate" or "compare"), and a
    # `bench compare` records per engine whether it ran, was skipped or failed, and why
    """
    ALTER TABLE requests RENAME COLUMN grp TO determinism_group;
    ALTER TABLE metrics RENAME COLUMN mkey TO key;
    ALTER TABLE runs ADD COLUMN kind VARCHAR DEFAULT 'gate';
    CREATE TABLE arm_outcomes (
        run_id VARCHAR NOT NULL, arm VARCHAR NOT NULL,
        status VARCHAR NOT NULL CHECK (status IN ('ran', 'skipped', 'failed')),
        error VARCHAR, open_s DOUBLE, recorded_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, arm)
    );
    """,
    # 4: a gate run records per arm the environment class its deterministic evidence holds for, and which
    # workloads' rows it copied from an earlier run (--reuse-baseline, gates/baseline_reuse.py)
    """
    ALTER TABLE arm_outcomes ADD COLUMN environment_class_json VARCHAR;
    ALTER TABLE arm_outcomes ADD COLUMN reused_evidence_json VARCHAR;
    """,
]
