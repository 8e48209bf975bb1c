#!/usr/bin/env bash
# Measures what refund bookkeeping costs a backend: a guarded INSERT of
# BENCH_MEM_ROWS rows (1 000 000) over 100 tenants, with the row guard,
# rolled back; then BENCH_MEM_SUBXACTS (10 000) PL/pgSQL exception blocks
# that fail, in the same transaction. Prints the backend's memory
# (pg_backend_memory_contexts, all contexts) before the insert, after it,
# after the exception blocks, and checks that the rollback gave back every
# unit. A measurement, not a test: the tests assert a bound on fewer rows.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${BENCH_MEM_ROWS:-1000000}
subxacts=${BENCH_MEM_SUBXACTS:-10000}

. sql_tests/lib.sh
rl_build_install
rl_cluster_start

psql -X -q -v ON_ERROR_STOP=1 -v rows="$rows" -v subxacts="$subxacts" <<'SQL'
CREATE EXTENSION rl_redis;
INSERT INTO rl_policy (name, algorithm, lim, window_ms)
    VALUES ('bench.mem', 'token_bucket', 2000000000, 86400000);
CREATE TABLE guarded (id bigserial PRIMARY KEY, tenant_id int);
CREATE TRIGGER guard AFTER INSERT ON guarded
    FOR EACH ROW EXECUTE FUNCTION rl_guard('bench.mem', 'tenant_id');
CREATE FUNCTION pg_temp.mem() RETURNS bigint LANGUAGE sql
    AS 'SELECT sum(total_bytes)::bigint FROM pg_backend_memory_contexts';
CREATE FUNCTION pg_temp.fail_many(n int) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. n LOOP
        BEGIN
            PERFORM 1 / 0;
        EXCEPTION WHEN division_by_zero THEN
            NULL;
        END;
    END LOOP;
END $$;
\timing on
BEGIN;
SELECT pg_temp.mem() AS before_bytes \gset
INSERT INTO guarded (tenant_id) SELECT g % 100 FROM generate_series(1, :rows) g;
SELECT pg_temp.mem() AS after_insert_bytes \gset
SELECT pg_temp.fail_many(:subxacts);
SELECT pg_temp.mem() AS after_subxacts_bytes \gset
ROLLBACK;
\timing off
SELECT min((rl_check('bench.mem', t::text, 0)).remaining) = 2000000000 AS all_given_back
  FROM generate_series(0, 99) t \gset
\echo
\echo rows :rows, exception blocks :subxacts
\echo backend memory before the insert:         :before_bytes bytes
\echo after the guarded insert (before ROLLBACK): :after_insert_bytes bytes
\echo after the exception blocks:                :after_subxacts_bytes bytes
\echo every unit given back by the rollback:     :all_given_back
SQL
