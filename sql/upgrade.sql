-- The upgrade path from 1.0 gives the same objects as a new install.
CREATE TEMP TABLE objects_new AS
SELECT pg_describe_object(classid, objid, objsubid) AS object
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis');
DROP EXTENSION rl_redis;
CREATE EXTENSION rl_redis VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
ALTER EXTENSION rl_redis UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
SELECT object FROM objects_new
EXCEPT
SELECT pg_describe_object(classid, objid, objsubid)
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis');
SELECT count(*) AS objects FROM objects_new;
-- administrative functions are not for PUBLIC
SELECT p.proname
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid
 WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND NOT has_function_privilege('public', p.oid, 'EXECUTE')
 ORDER BY 1;
SELECT has_table_privilege('public', 'rl_policy', 'SELECT') AS public_reads_policies,
       has_table_privilege('public', 'rl_policy', 'INSERT') AS public_writes_policies;
