/*
 * algorithms.h
 *	  The table of rate-limit algorithms: one line each.
 *
 * RL_ALGORITHM(name, lua_file, key_kind, refund_subtracts, keeps_records, log, bucket)
 *   name              in rl_policy.algorithm, in Lua (ALG.<name>) and in
 *                     the SQL functions rl_<name>, rl_<name>_allow and
 *                     rl_<name>_refund
 *   lua_file          lua/<lua_file>.lua, which defines ALG.<name>
 *   key_kind          the kind its keys are named with (rl_build_key): the
 *                     name, followed by ".<n>" from the n-th layout of its
 *                     state on, so that sessions still running an earlier
 *                     release (which read only the earlier layout) never
 *                     meet a key of the new one; they count apart until
 *                     they end, and the keys of the earlier layout expire
 *   refund_subtracts  a refund subtracts units, so it must not be sent twice
 *   keeps_records     the key keeps refund records, which the forget call
 *                     removes when the charging transaction commits (its
 *                     one-algorithm script includes lua/records.lua)
 *   log               one entry per unit: lim is bounded by
 *                     rl_redis.sliding_max_lim
 *   bucket            the state is a bucket's level, which depends on the
 *                     rate (lim per window_ms) and the capacity (the burst,
 *                     which only these take): a policy's key carries all
 *                     three. Otherwise the state is a count over window_ms
 *                     and lim only the threshold it is compared with: a
 *                     policy's key carries window_ms alone (rl_build_key)
 *
 * C includes this file with RL_ALGORITHM defined; src/embed_lua.sh reads the
 * same lines to build the scripts. Adding an algorithm: its Lua file, one
 * line here and an SQL script creating its functions.
 */
RL_ALGORITHM(fixed, fixed_window, "fixed.2", true, false, false, false)
RL_ALGORITHM(sliding, sliding_window, "sliding", false, false, true, false)
RL_ALGORITHM(token_bucket, token_bucket, "token_bucket.2", false, true, false, true)
RL_ALGORITHM(gcra, gcra, "gcra.2", false, true, false, true)
RL_ALGORITHM(sliding_counter, sliding_counter, "sliding_counter.2", true, false, false, false)
