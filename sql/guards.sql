-- Guard triggers and refunds on abort, on a frozen test clock.
SET rl_redis.key_prefix = 'rltest:';
SET rl_redis.test_clock_ms = 1000000000000;
SELECT rl_reset('acme'), rl_reset('acme:7'), rl_reset('globex'), rl_reset('acme:8');
INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('llm.free', 'fixed', 3, 60000);

CREATE TABLE llm_requests (
    id serial PRIMARY KEY,
    tenant_id text,
    user_id int,
    tokens int
);

-- row guard on a policy: one unit per row
CREATE TRIGGER llm_guard AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id');
INSERT INTO llm_requests (tenant_id) VALUES ('acme'), ('acme');
SELECT * FROM rl_check('llm.free', 'acme', 0);
-- the 4th row is denied: the statement fails whole, and the 3rd row's unit,
-- taken before, is given back
DO $$
DECLARE
    state text; msg text; detail text; hint text; sch text; tbl text;
BEGIN
    INSERT INTO llm_requests (tenant_id) VALUES ('acme'), ('acme');
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT,
        detail = PG_EXCEPTION_DETAIL, hint = PG_EXCEPTION_HINT,
        sch = SCHEMA_NAME, tbl = TABLE_NAME;
    RAISE NOTICE 'sqlstate %, message "%", detail "%", hint "%", table %.%',
        state, msg, detail, hint, sch, tbl;
END $$;
SELECT * FROM rl_check('llm.free', 'acme', 0);
SELECT count(*) FROM llm_requests;
-- another tenant is not affected
INSERT INTO llm_requests (tenant_id) VALUES ('globex');
INSERT INTO llm_requests (tenant_id) VALUES ('acme');
INSERT INTO llm_requests (tenant_id) VALUES ('acme');
-- a NULL identity is an error, not a free pass
INSERT INTO llm_requests (tenant_id) VALUES (NULL);
\echo :LAST_ERROR_SQLSTATE
DROP TRIGGER llm_guard ON llm_requests;

-- row guard on an explicit limit, identity from two columns, a cost column
CREATE TRIGGER llm_guard AFTER INSERT OR UPDATE ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('sliding:100/60000', 'tenant_id, user_id', 'tokens');
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 7, 60);
SELECT * FROM rl_sliding('acme:7', 100, 60000, 0);
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 7, 41);
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 7, 40), ('acme', 8, 0);
SELECT * FROM rl_sliding('acme:7', 100, 60000, 0);
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 7, NULL);
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 7, -1);
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', NULL, 1);

-- refunds: a rolled-back subtransaction gives back its units, a committed
-- one hands them to its transaction, and an aborted transaction gives back
-- everything
BEGIN;
SAVEPOINT a;
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 8, 30);
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
ROLLBACK TO a;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
SAVEPOINT b;
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 8, 20);
RELEASE b;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
ROLLBACK;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
-- a commit keeps them
BEGIN;
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 8, 20);
COMMIT;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
-- in PL/pgSQL, an exception block is a subtransaction
DO $$
BEGIN
    INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 8, 10);
    RAISE EXCEPTION 'the model call failed';
EXCEPTION WHEN raise_exception THEN
    RAISE NOTICE 'caught: %', SQLERRM;
END $$;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
-- explicit calls are not refunded unless refund_on_abort = all
BEGIN;
SELECT rl_sliding_allow('acme:8', 100, 60000, 5);
ROLLBACK;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
SET rl_redis.refund_on_abort = 'all';
BEGIN;
SELECT rl_sliding_allow('acme:8', 100, 60000, 5);
SELECT rl_check('llm.free', 'acme:8', 2) IS NOT NULL;
ROLLBACK;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining,
       (rl_check('llm.free', 'acme:8', 0)).remaining;
-- and nothing is refunded when it is off
SET rl_redis.refund_on_abort = 'off';
BEGIN;
INSERT INTO llm_requests (tenant_id, user_id, tokens) VALUES ('acme', 8, 10);
ROLLBACK;
SELECT (rl_sliding('acme:8', 100, 60000, 0)).remaining;
RESET rl_redis.refund_on_abort;
DROP TRIGGER llm_guard ON llm_requests;

-- statement guard: each identity charged its rows in one call, all or nothing
CREATE TRIGGER llm_guard AFTER INSERT ON llm_requests
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('fixed:10/60000', 'tenant_id');
SELECT rl_reset('acme'), rl_reset('globex');
INSERT INTO llm_requests (tenant_id) SELECT 'acme' FROM generate_series(1, 6);
INSERT INTO llm_requests (tenant_id) SELECT 'globex' FROM generate_series(1, 4);
-- 5 more for acme would be 11: the whole statement is refused, globex's
-- 3 rows in it are not charged either
INSERT INTO llm_requests (tenant_id)
    SELECT 'acme' FROM generate_series(1, 5) UNION ALL SELECT 'globex' FROM generate_series(1, 3);
SELECT (rl_fixed('acme', 10, 60000, 0)).remaining AS acme, (rl_fixed('globex', 10, 60000, 0)).remaining AS globex;
INSERT INTO llm_requests (tenant_id)
    SELECT 'acme' FROM generate_series(1, 4) UNION ALL SELECT 'globex' FROM generate_series(1, 3);
SELECT (rl_fixed('acme', 10, 60000, 0)).remaining AS acme, (rl_fixed('globex', 10, 60000, 0)).remaining AS globex;
-- a later failure in the transaction gives the statement's units back
BEGIN;
INSERT INTO llm_requests (tenant_id) SELECT 'globex' FROM generate_series(1, 3);
SELECT (rl_fixed('globex', 10, 60000, 0)).remaining;
SELECT 1 / 0;
ROLLBACK;
SELECT (rl_fixed('globex', 10, 60000, 0)).remaining;
INSERT INTO llm_requests (tenant_id) VALUES (NULL);
DROP TRIGGER llm_guard ON llm_requests;

-- wrong set-ups are clear errors, at CREATE TRIGGER (the event trigger
-- rl_guard_created runs the guard's own checks)
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'no_such_column');
-- a missing policy is only a warning (restores create triggers before
-- rl_policy's rows): the guard is made, and a write fails
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('no_such_policy', 'tenant_id');
INSERT INTO llm_requests (tenant_id) VALUES ('t1');
DROP TRIGGER bad ON llm_requests;
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('fixed:0/1000', 'tenant_id');
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('fixed:10/minute', 'tenant_id');
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id', 'tenant_id');
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free');
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('llm.free', 'tenant_id');
-- a row guard fires after the write: a BEFORE trigger would also charge rows
-- that INSERT ... ON CONFLICT skips or turns into an update
CREATE TRIGGER bad BEFORE INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id');
\echo :LAST_ERROR_SQLSTATE
CREATE TRIGGER bad AFTER INSERT ON llm_requests
    FOR EACH STATEMENT EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id');
SELECT count(*) FROM pg_trigger WHERE tgrelid = 'llm_requests'::regclass;
-- a guard made without the check (before 1.6) still refuses to fire, and
-- rl_guard_check() lists it
BEGIN;
ALTER EVENT TRIGGER rl_guard_created DISABLE;
CREATE TRIGGER bad BEFORE INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id');
ALTER EVENT TRIGGER rl_guard_created ENABLE;
COMMIT;
INSERT INTO llm_requests (tenant_id) VALUES ('acme');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM rl_guard_check();
DROP TRIGGER bad ON llm_requests;
SELECT * FROM rl_guard_check();

DROP TABLE llm_requests;
DELETE FROM rl_policy;
SELECT rl_reset('acme'), rl_reset('acme:7'), rl_reset('globex'), rl_reset('acme:8');
RESET rl_redis.test_clock_ms;
