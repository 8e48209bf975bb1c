/*
 * compat.h: the differences between the PostgreSQL majors that rl_redis
 * builds on (15, 16, 17, 18), in one place. The .c files use the names
 * below and never test PG_VERSION_NUM themselves; rl_redis.h includes this
 * header, so every file has it.
 *
 * 16: the varlena macros (VARDATA_ANY, VARSIZE_ANY_EXHDR, ...) moved from
 *     postgres.h to varatt.h.
 * 17: CreateWaitEventSet() takes the ResourceOwner that tracks the set
 *     instead of a memory context; NULL means "no owner, freed by hand",
 *     which is what the 15/16 sets in TopMemoryContext were (conn.c
 *     frees its set with FreeWaitEventSet when the connection closes).
 *     PGPROC lost pgprocno: a backend's number in the proc array is
 *     MyProcNumber (storage/procnumber.h, through storage/proc.h).
 *     An interval can be infinite ('infinity', '-infinity').
 */
#ifndef RL_COMPAT_H
#define RL_COMPAT_H

#include "postgres.h"

#include "storage/latch.h"
#include "datatype/timestamp.h"
#include "storage/proc.h"
#include "utils/memutils.h"

#if PG_VERSION_NUM >= 160000
#include "varatt.h"
#endif

#if PG_VERSION_NUM < 150000
#error "rl_redis needs PostgreSQL 15 or later"
#endif

/* A wait event set of nevents events that lives until FreeWaitEventSet. */
#if PG_VERSION_NUM >= 170000
#define rl_create_wait_event_set(nevents) CreateWaitEventSet(NULL, (nevents))
#else
#define rl_create_wait_event_set(nevents) CreateWaitEventSet(TopMemoryContext, (nevents))
#endif

/* This backend's index in the proc array (0 .. MaxBackends + aux - 1). */
#if PG_VERSION_NUM >= 170000
#define rl_my_proc_number() ((int) MyProcNumber)
#else
#define rl_my_proc_number() ((int) MyProc->pgprocno)
#endif

/* 1 for an interval of +infinity, -1 for -infinity, 0 for a finite one. */
#if PG_VERSION_NUM >= 170000
#define rl_interval_infinity(span) \
	(INTERVAL_IS_NOEND(span) ? 1 : INTERVAL_IS_NOBEGIN(span) ? -1 : 0)
#else
#define rl_interval_infinity(span) 0
#endif

#endif							/* RL_COMPAT_H */
