-- The upgrade path from 1.0 gives the same objects as a new install.
-- PostgreSQL 17 and later also record the row types of the extension's
-- table and view and the array types as members; 15 and 16 do not: those
-- implicit types are left out, so that every version counts the same.
CREATE TEMP VIEW extension_objects AS
SELECT pg_describe_object(d.classid, d.objid, d.objsubid) AS object
  FROM pg_depend d
  LEFT JOIN pg_type t ON d.classid = 'pg_type'::regclass AND t.oid = d.objid
  LEFT JOIN pg_class c ON c.oid = t.typrelid
 WHERE d.refclassid = 'pg_extension'::regclass
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND (t.oid IS NULL OR (t.typcategory <> 'A' AND coalesce(c.relkind, 'c') = 'c'));
CREATE TEMP TABLE objects_new AS SELECT object FROM extension_objects;
DROP EXTENSION rl_redis;
CREATE EXTENSION rl_redis VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
ALTER EXTENSION rl_redis UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
SELECT object FROM objects_new
EXCEPT
SELECT object FROM extension_objects;
SELECT count(*) AS objects FROM objects_new;
-- administrative functions are not for PUBLIC
SELECT p.proname
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid
 WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND NOT has_function_privilege('public', p.oid, 'EXECUTE')
 ORDER BY 1;
SELECT has_table_privilege('public', 'rl_policy', 'SELECT') AS public_reads_policies,
       has_table_privilege('public', 'rl_policy', 'INSERT') AS public_writes_policies;
