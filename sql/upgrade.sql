-- The upgrade path from 1.0 gives the same objects as a new install.
-- PostgreSQL 17 and later also record the row types of the extension's
-- table and view and the array types as members; 15 and 16 do not: those
-- implicit types are left out, so that every version counts the same.
CREATE TEMP VIEW extension_objects AS
SELECT pg_describe_object(d.classid, d.objid, d.objsubid) AS object, ds.description
  FROM pg_depend d
  LEFT JOIN pg_type t ON d.classid = 'pg_type'::regclass AND t.oid = d.objid
  LEFT JOIN pg_class c ON c.oid = t.typrelid
  LEFT JOIN pg_description ds
    ON (ds.classoid, ds.objoid, ds.objsubid) = (d.classid, d.objid, d.objsubid)
 WHERE d.refclassid = 'pg_extension'::regclass
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND (t.oid IS NULL OR (t.typcategory <> 'A' AND coalesce(c.relkind, 'c') = 'c'));
-- The constraints and triggers of the extension's tables, which are not
-- members themselves (NOT NULL constraints, rows of pg_constraint from
-- PostgreSQL 18 on, are left out: they have no name of ours).
CREATE TEMP VIEW extension_table_parts AS
SELECT pg_describe_object(p.classid, p.objid, 0) AS object, ds.description
  FROM (SELECT 'pg_constraint'::regclass AS classid, oid AS objid, conrelid AS relid
          FROM pg_constraint WHERE contype <> 'n'
        UNION ALL
        SELECT 'pg_trigger'::regclass, oid, tgrelid
          FROM pg_trigger WHERE NOT tgisinternal) p
  JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = p.relid
  LEFT JOIN pg_description ds
    ON (ds.classoid, ds.objoid, ds.objsubid) = (p.classid, p.objid, 0)
 WHERE d.refclassid = 'pg_extension'::regclass
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis');
-- Every one of them says what it is (COMMENT ON), after a new install and
-- after the upgrade path.
CREATE TEMP VIEW undescribed AS
SELECT object FROM extension_objects WHERE description IS NULL
UNION ALL
SELECT object FROM extension_table_parts WHERE description IS NULL;
SELECT object FROM undescribed ORDER BY 1;
SELECT object FROM extension_table_parts ORDER BY 1;
CREATE TEMP TABLE objects_new AS SELECT * FROM extension_objects;
CREATE TEMP TABLE parts_new AS SELECT * FROM extension_table_parts;
DROP EXTENSION rl_redis;
CREATE EXTENSION rl_redis VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
ALTER EXTENSION rl_redis UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'rl_redis';
SELECT object FROM undescribed ORDER BY 1;
-- the same objects, constraint names and descriptions
SELECT * FROM objects_new
EXCEPT
SELECT * FROM extension_objects;
SELECT * FROM parts_new
EXCEPT
SELECT * FROM extension_table_parts;
SELECT count(*) AS objects FROM objects_new;
-- administrative functions are not for PUBLIC
SELECT p.proname
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid
 WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND NOT has_function_privilege('public', p.oid, 'EXECUTE')
 ORDER BY 1;
-- a description says "for every role." exactly when PUBLIC may execute it
SELECT p.oid::regprocedure::text AS function
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid
 WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')
   AND has_function_privilege('public', p.oid, 'EXECUTE')
       <> (coalesce(obj_description(p.oid, 'pg_proc'), '') LIKE '%; for every role.')
 ORDER BY 1;
SELECT has_table_privilege('public', 'rl_policy', 'SELECT') AS public_reads_policies,
       has_table_privilege('public', 'rl_policy', 'INSERT') AS public_writes_policies;
