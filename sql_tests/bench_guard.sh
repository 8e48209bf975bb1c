#!/usr/bin/env bash
# Measures what the guards cost on a bulk insert: a 100 000-row
# INSERT ... SELECT over 100 tenants into a plain table, a table with the
# statement guard, and a table with the (AFTER INSERT) row guard, on a
# throwaway cluster.
# Prints the median times and the ratios to the plain insert (target for the
# statement guard: at most 1.2). A measurement, not a test.
#   BENCH_ROWS (100000), BENCH_RUNS (15), BENCH_ROW_RUNS (3)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${BENCH_ROWS:-100000}
runs=${BENCH_RUNS:-15}
row_runs=${BENCH_ROW_RUNS:-3}

. sql_tests/lib.sh
rl_build_install
rl_cluster_start

psql -X -q -v ON_ERROR_STOP=1 -v rows="$rows" -v runs="$runs" -v row_runs="$row_runs" <<'SQL'
CREATE EXTENSION rl_redis;
CREATE TABLE plain (id bigserial PRIMARY KEY, tenant_id int, payload text);
CREATE TABLE stmt_guarded (LIKE plain INCLUDING ALL);
CREATE TABLE row_guarded (LIKE plain INCLUDING ALL);
CREATE TRIGGER guard AFTER INSERT ON stmt_guarded REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('fixed:2000000000/86400000', 'tenant_id');
CREATE TRIGGER guard AFTER INSERT ON row_guarded
    FOR EACH ROW EXECUTE FUNCTION rl_guard('fixed:2000000000/86400000', 'tenant_id');
CREATE TEMP TABLE timing (tbl text, ms float8);
CREATE FUNCTION pg_temp.load(tbl text, n int) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz;
BEGIN
    EXECUTE format('TRUNCATE %I', tbl);
    t0 := clock_timestamp();
    EXECUTE format('INSERT INTO %I (tenant_id, payload) SELECT g %% 100, md5(g::text) FROM generate_series(1, %s) g', tbl, n);
    RETURN extract(epoch FROM clock_timestamp() - t0) * 1000;
END $$;
-- warm-up
SELECT pg_temp.load('plain', :rows) IS NOT NULL AS warm, pg_temp.load('stmt_guarded', :rows) IS NOT NULL AS warm2 \g /dev/null
-- alternate the tables, and which goes first, so that load on the machine
-- and the order hit both alike
INSERT INTO timing SELECT t, pg_temp.load(t, :rows)
  FROM generate_series(1, :runs) i,
       unnest(CASE WHEN i % 2 = 0 THEN ARRAY['plain', 'stmt_guarded']
                   ELSE ARRAY['stmt_guarded', 'plain'] END) WITH ORDINALITY AS u(t, o)
 ORDER BY i, o;
INSERT INTO timing SELECT 'row_guarded', pg_temp.load('row_guarded', :rows)
  FROM generate_series(1, :row_runs);
\echo
\echo 'INSERT ... SELECT of ' :rows ' rows over 100 tenants (median of the runs):'
SELECT tbl AS "table", count(*) AS runs,
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1) AS median_ms,
       round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) /
              (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) FROM timing WHERE tbl = 'plain'))::numeric, 2)
           AS ratio_to_plain
  FROM timing GROUP BY tbl ORDER BY median_ms;
SQL
echo "target: statement guard ratio <= 1.20 ($(nproc) cores, $(pg_config --version), $(redis-server --version | cut -d' ' -f3))"
