/*
 * breaker.c
 *	  The circuit breaker in front of a Redis connection (each connection
 *	  has its own RlBreaker).
 *
 * After a call fails to reach Redis (connect, send, receive, timeout), the
 * calls within rl_redis.retry_interval fail at once with the same failure,
 * without touching the network, so that a Redis outage costs a backend
 * microseconds per call instead of a timeout per call. The first call after
 * the interval tries again. An outage is reported once: the failure that
 * starts it is marked first_in_outage (the caller warns only for that one),
 * and the first success after it is logged.
 */
#include "postgres.h"

#include "utils/timestamp.h"

#include "rl_redis.h"

/*
 * True when the breaker is open: the call must not touch the network, and
 * failure holds the failure to report.
 */
bool
rl_breaker_open(RlBreaker *b, RlFailure *failure)
{
	if (b->last_failure_at == 0 || rl_retry_interval <= 0)
		return false;
	if (!TimestampDifferenceExceeds(b->last_failure_at, GetCurrentTimestamp(),
									rl_retry_interval))
	{
		*failure = b->last_failure;
		failure->first_in_outage = false;
		failure->breaker_opened = false;
		failure->held_back = true;
		return true;
	}
	return false;
}

/* Records a failed call; the first of an outage is marked first_in_outage. */
void
rl_breaker_failed(RlBreaker *b, RlFailure *failure)
{
	b->last_failure_at = GetCurrentTimestamp();
	failure->first_in_outage = (b->outage_start == 0);
	failure->breaker_opened = failure->first_in_outage;
	if (b->outage_start == 0)
		b->outage_start = b->last_failure_at;
	b->last_failure = *failure;
}

/*
 * Records a call that reached Redis, and logs the end of an outage at
 * server.
 */
void
rl_breaker_succeeded(RlBreaker *b, const char *server)
{
	if (b->outage_start != 0)
		ereport(LOG,
				(errmsg("connection to Redis at %s restored after " INT64_FORMAT " ms",
						server,
						(int64) ((GetCurrentTimestamp() - b->outage_start) / 1000))));
	b->outage_start = 0;
	b->last_failure_at = 0;
}

/* Forgets the outage, so that the next call tries the network. */
void
rl_breaker_reset(RlBreaker *b)
{
	b->last_failure_at = 0;
	b->outage_start = 0;
}
