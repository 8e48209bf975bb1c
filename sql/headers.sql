-- rl_headers: what the HTTP response headers say.
SET rl_redis.key_prefix = 'rlhdr:';
SET rl_redis.test_clock_ms = 1000000000000;
SELECT rl_reset('hdr:u1'), rl_reset('hdr:u2');
INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES
    ('hdr.tb',      'token_bucket',    60,   60000,  120),
    ('hdr.gcra',    'gcra',            10,    1000,    2),
    ('hdr.fixed',   'fixed',            3,    1500, NULL),
    ('hdr.sliding', 'sliding',          5,   60000, NULL),
    ('hdr.counter', 'sliding_counter', 100, 3600000, NULL);

-- RateLimit-Policy advertises the rate of the policy (q = lim per w = window
-- in seconds, rounded up), not the burst that a token bucket or GCRA result
-- carries as its lim; the other fields report the result as it is
SELECT rl_headers(rl_check('hdr.tb', 'hdr:u1'), 'hdr.tb');
SELECT rl_headers(rl_check('hdr.gcra', 'hdr:u1'), 'hdr.gcra');
SELECT rl_headers(rl_check('hdr.fixed', 'hdr:u1'), 'hdr.fixed');
SELECT rl_headers(rl_check('hdr.sliding', 'hdr:u1', 0), 'hdr.sliding');
SELECT rl_headers(rl_check('hdr.counter', 'hdr:u1', 0), 'hdr.counter');

-- a denied call says when to come back (Retry-After, seconds rounded up)
SELECT rl_allow('hdr.fixed', 'hdr:u1', 2);
SELECT rl_headers(rl_check('hdr.fixed', 'hdr:u1'), 'hdr.fixed');
SELECT rl_headers(rl_check('hdr.gcra', 'hdr:u2', 2), 'hdr.gcra');
SELECT rl_headers(rl_check('hdr.gcra', 'hdr:u2'), 'hdr.gcra');
-- a result that can never be allowed has no Retry-After
SELECT rl_headers(ROW(false, 5, 0, 0, -1)::rl_result, 'hdr.fixed');

-- the policy named follows a change of the table
UPDATE rl_policy SET lim = 90, window_ms = 30500 WHERE name = 'hdr.tb';
SELECT rl_headers(ROW(true, 120, 7, 500, 0)::rl_result, 'hdr.tb');

-- no policy: "default"; a name that is not a policy: no RateLimit-Policy
SELECT rl_headers(ROW(true, 100, 42, 1500, 0)::rl_result);
SELECT rl_headers(ROW(true, 100, 42, 1500, 0)::rl_result, 'not.a.policy');

-- the name is an RFC 8941 string: '"' and '\' are escaped, any character
-- of 0x20 to 0x7E goes out as it is
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, 'say "hi" \ bye');
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, ' ~!#$%&''()*+,-./09:;<=>?@AZ[]^_`az{|}');
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, '') ->> 0 AS empty_name;
-- the JSON value decodes to exactly the header line
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, 'a"b\c') -> 0 ->> 'RateLimit' AS header;

-- anything else is refused: no header injection, no non-ASCII bytes
\set VERBOSITY sqlstate
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, E'x\r\nSet-Cookie: a=b');
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, E'x\ny');
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, E'tab\there');
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, 'caf' || chr(233));
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, 'del' || chr(127));
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, 'ctl' || chr(31));
SELECT rl_headers(NULL::rl_result, 'hdr.tb');
SELECT rl_headers(ROW(NULL, 1, 0, 0, 0)::rl_result);
\set VERBOSITY default
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, E'x\r\nSet-Cookie: a=b');

-- the same whatever standard_conforming_strings says
SET standard_conforming_strings = off;
SELECT rl_headers(ROW(true, 1, 0, 0, 0)::rl_result, E'a"b\\c') -> 0 ->> 'RateLimit' AS header;
RESET standard_conforming_strings;

SELECT rl_reset('hdr:u1'), rl_reset('hdr:u2');
DELETE FROM rl_policy WHERE name LIKE 'hdr.%';
RESET rl_redis.test_clock_ms;
RESET rl_redis.key_prefix;
