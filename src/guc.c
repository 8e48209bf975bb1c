/*
 * guc.c
 *	  The rl_redis.* settings.
 *
 * Everything that decides where the limits live or how strict they are is
 * superuser-only (PGC_SUSET): an ordinary role must not be able to point the
 * server at another Redis, read the password, or make its own calls fail
 * open (a tiny timeout with on_error = allow would do that, so the timeouts
 * are superuser-only too).
 */
#include "postgres.h"

#include <limits.h>

#include "utils/guc.h"

#include "rl_redis.h"

char	   *rl_host = NULL;
int			rl_port = 6379;
char	   *rl_username = NULL;
char	   *rl_password = NULL;
int			rl_database = 0;
int			rl_connect_timeout = 2000;
int			rl_command_timeout = 2000;
int			rl_retry_interval = 1000;
char	   *rl_key_prefix = NULL;
int			rl_on_error = RL_ON_ERROR_ERROR;
int			rl_refund_on_abort = RL_REFUND_GUARDS;
double		rl_test_clock_ms = 0;
bool		rl_tls = false;
char	   *rl_tls_ca_file = NULL;
char	   *rl_tls_cert_file = NULL;
char	   *rl_tls_key_file = NULL;
char	   *rl_tls_server_name = NULL;

/* set whenever a connection setting is assigned; the transport reconnects */
bool		rl_connection_settings_changed = false;

static const struct config_enum_entry on_error_options[] = {
	{"error", RL_ON_ERROR_ERROR, false},
	{"allow", RL_ON_ERROR_ALLOW, false},
	{"deny", RL_ON_ERROR_DENY, false},
	{NULL, 0, false}
};

static const struct config_enum_entry refund_on_abort_options[] = {
	{"off", RL_REFUND_OFF, false},
	{"guards", RL_REFUND_GUARDS, false},
	{"all", RL_REFUND_ALL, false},
	{NULL, 0, false}
};

/* Marks the open connection as stale after a connection setting changed. */
static void
assign_connection_string(const char *newval, void *extra)
{
	rl_connection_settings_changed = true;
}

/* Same as assign_connection_string, for the integer settings. */
static void
assign_connection_int(int newval, void *extra)
{
	rl_connection_settings_changed = true;
}

/* Same as assign_connection_string, for rl_redis.tls. */
static void
assign_connection_bool(bool newval, void *extra)
{
	rl_connection_settings_changed = true;
}

/* Rejects an empty rl_redis.host. */
static bool
check_host(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0')
	{
		GUC_check_errdetail("rl_redis.host must not be empty.");
		return false;
	}
	return true;
}

/* Keeps rl_redis.key_prefix free of bytes that make keys hard to handle. */
static bool
check_key_prefix(char **newval, void **extra, GucSource source)
{
	const char *p;

	if (*newval == NULL)
		return true;
	if (strlen(*newval) > 256)
	{
		GUC_check_errdetail("rl_redis.key_prefix must be at most 256 bytes long.");
		return false;
	}
	for (p = *newval; *p; p++)
	{
		if (*p == '{' || *p == '}' || (unsigned char) *p < 0x20)
		{
			GUC_check_errdetail("rl_redis.key_prefix must not contain braces or control characters.");
			return false;
		}
	}
	return true;
}

/* Defines every rl_redis.* setting; called once from _PG_init. */
void
rl_define_gucs(void)
{
	DefineCustomStringVariable("rl_redis.host",
							   "Redis host name or address, or the path of a Unix socket.",
							   "A value starting with a slash is taken as a Unix-domain socket path.",
							   &rl_host,
							   "127.0.0.1",
							   PGC_SUSET,
							   0,
							   check_host, assign_connection_string, NULL);

	DefineCustomIntVariable("rl_redis.port",
							"Redis TCP port.",
							NULL,
							&rl_port,
							6379, 1, 65535,
							PGC_SUSET,
							0,
							NULL, assign_connection_int, NULL);

	DefineCustomStringVariable("rl_redis.username",
							   "Redis ACL user name sent with AUTH.",
							   "Empty means the default user (AUTH with the password alone).",
							   &rl_username,
							   "",
							   PGC_SUSET,
							   0,
							   NULL, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.password",
							   "Redis password sent with AUTH.",
							   "Empty means no AUTH.",
							   &rl_password,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY | GUC_NO_SHOW_ALL,
							   NULL, assign_connection_string, NULL);

	DefineCustomBoolVariable("rl_redis.tls",
							 "Whether to connect to Redis with TLS.",
							 "The server's certificate is always checked, against rl_redis.tls_ca_file or the system's CAs, and its name against rl_redis.tls_server_name or rl_redis.host.",
							 &rl_tls,
							 false,
							 PGC_SUSET,
							 0,
							 NULL, assign_connection_bool, NULL);

	DefineCustomStringVariable("rl_redis.tls_ca_file",
							   "File of CA certificates that the Redis server's certificate must chain to.",
							   "Empty uses the system's CA certificates.",
							   &rl_tls_ca_file,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY,
							   NULL, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.tls_cert_file",
							   "Client certificate for Redis servers that require one.",
							   NULL,
							   &rl_tls_cert_file,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY,
							   NULL, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.tls_key_file",
							   "Private key of the client certificate.",
							   "Empty takes the key from rl_redis.tls_cert_file.",
							   &rl_tls_key_file,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY,
							   NULL, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.tls_server_name",
							   "Name the Redis server's certificate must carry (and the SNI sent).",
							   "Empty uses rl_redis.host.",
							   &rl_tls_server_name,
							   "",
							   PGC_SUSET,
							   0,
							   NULL, assign_connection_string, NULL);

	DefineCustomIntVariable("rl_redis.database",
							"Redis logical database number (SELECT).",
							NULL,
							&rl_database,
							0, 0, INT_MAX,
							PGC_SUSET,
							0,
							NULL, assign_connection_int, NULL);

	DefineCustomIntVariable("rl_redis.connect_timeout",
							"Time allowed for connecting to Redis, AUTH and SELECT included.",
							NULL,
							&rl_connect_timeout,
							2000, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.command_timeout",
							"Time allowed for one Redis command, from sending it to its whole reply.",
							"Zero waits without limit (statement_timeout still applies).",
							&rl_command_timeout,
							2000, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.retry_interval",
							"Time after a failure to reach Redis during which calls fail at once.",
							"Zero tries Redis on every call.",
							&rl_retry_interval,
							1000, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomStringVariable("rl_redis.key_prefix",
							   "Prefix of every Redis key rl_redis reads or writes.",
							   NULL,
							   &rl_key_prefix,
							   "rl:",
							   PGC_SUSET,
							   0,
							   check_key_prefix, NULL, NULL);

	DefineCustomEnumVariable("rl_redis.on_error",
							 "What a decision returns when Redis cannot be reached or fails.",
							 "error raises an error; allow and deny log a warning and return that decision.",
							 &rl_on_error,
							 RL_ON_ERROR_ERROR,
							 on_error_options,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	DefineCustomEnumVariable("rl_redis.refund_on_abort",
							 "Whose units an aborted transaction or subtransaction gives back.",
							 "guards: those taken by rl_guard and rl_guard_statement; all: also those of the decision functions; off: none.",
							 &rl_refund_on_abort,
							 RL_REFUND_GUARDS,
							 refund_on_abort_options,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	DefineCustomRealVariable("rl_redis.test_clock_ms",
							 "Fixed clock for tests, in milliseconds since the epoch.",
							 "Zero (the default) uses the Redis server's clock. For tests only.",
							 &rl_test_clock_ms,
							 0, 0, 1e15,
							 PGC_SUSET,
							 GUC_NOT_IN_SAMPLE,
							 NULL, NULL, NULL);

	MarkGUCPrefixReserved("rl_redis");
}
