/*
 * guc.c
 *	  The rl_redis.* settings.
 *
 * Everything that decides where the limits live or how strict they are is
 * superuser-only (PGC_SUSET): an ordinary role must not be able to point the
 * server at another Redis, read the password, or make its own calls fail
 * open (a tiny timeout with on_error = allow would do that, so the timeouts
 * are superuser-only too).
 *
 * The Redis password comes from rl_redis.password (postgresql.conf or ALTER
 * SYSTEM only: a database or role setting is readable by every role in
 * pg_db_role_setting, so the check hook refuses those) or from the file that
 * rl_redis.password_file names. The transport gets it through
 *
 *	bool rl_read_password(bool sentinel, bool log, char *buf, size_t size,
 *						  char *err, size_t errsize, RlHint *hint);
 */
#include "postgres.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include "miscadmin.h"
#include "utils/guc.h"

#include "rl_redis.h"


char	   *rl_host = NULL;
int			rl_port = 6379;
char	   *rl_username = NULL;
char	   *rl_password = NULL;
char	   *rl_password_file = NULL;
int			rl_database = 0;
int			rl_connect_timeout = 2000;
int			rl_command_timeout = 2000;
int			rl_retry_interval = 1000;
int			rl_idle_timeout = 0;
char	   *rl_key_prefix = NULL;
int			rl_on_error = RL_ON_ERROR_ERROR;
int			rl_refund_on_abort = RL_REFUND_GUARDS;
double		rl_test_clock_ms = 0;
int			rl_xact_end_budget = RL_XACT_END_BUDGET_MS;
int			rl_worker_restart_interval = RL_WORKER_RESTART_S;
int			rl_sentinel_recheck_interval = RL_SENTINEL_RECHECK_MS;
int			rl_slot_map_refresh_interval = RL_SLOT_MAP_REFRESH_MS;
int			rl_max_lease = 3600000;
int			rl_sliding_max_lim = 10000;
int			rl_max_identity_bytes = RL_DEFAULT_IDENTITY_BYTES;
bool		rl_tls = false;
bool		rl_stats = true;
bool		rl_deny_cache = false;
int			rl_transport = RL_TRANSPORT_BACKEND;
int			rl_shared_queue_size = 256;
bool		rl_track_denials = false;
char	   *rl_tls_ca_file = NULL;
char	   *rl_tls_cert_file = NULL;
char	   *rl_tls_key_file = NULL;
char	   *rl_tls_server_name = NULL;
int			rl_mode = RL_MODE_STANDALONE;
char	   *rl_nodes = NULL;
char	   *rl_sentinel_master = NULL;
char	   *rl_sentinel_password = NULL;

/*
 * Whether the library was preloaded: only then are the password settings
 * hidden from the start (before, they are placeholders every role reads).
 */
static bool secrets_hidden = false;

/* set whenever a connection setting is assigned; the transport reconnects */
bool		rl_connection_settings_changed = false;

static const struct config_enum_entry on_error_options[] = {
	{"error", RL_ON_ERROR_ERROR, false},
	{"allow", RL_ON_ERROR_ALLOW, false},
	{"deny", RL_ON_ERROR_DENY, false},
	{NULL, 0, false}
};

static const struct config_enum_entry mode_options[] = {
	{"standalone", RL_MODE_STANDALONE, false},
	{"cluster", RL_MODE_CLUSTER, false},
	{"sentinel", RL_MODE_SENTINEL, false},
	{NULL, 0, false}
};

static const struct config_enum_entry transport_options[] = {
	{"backend", RL_TRANSPORT_BACKEND, false},
	{"shared", RL_TRANSPORT_SHARED, false},
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

/*
 * True when a secret setting may take its value from source: not from a
 * database or role setting (ALTER DATABASE/ROLE ... SET and CREATE FUNCTION
 * ... SET validate with PGC_S_TEST, and such values come back as
 * PGC_S_GLOBAL, PGC_S_DATABASE, PGC_S_USER or PGC_S_DATABASE_USER), as
 * pg_db_role_setting and pg_proc.proconfig are readable by every role.
 * This runs only where the library is loaded, hence
 * shared_preload_libraries.
 */
static bool
rl_secret_source_ok(GucSource source)
{
	switch (source)
	{
		case PGC_S_TEST:
		case PGC_S_GLOBAL:
		case PGC_S_DATABASE:
		case PGC_S_USER:
		case PGC_S_DATABASE_USER:
			GUC_check_errdetail("Database, role and function settings are readable by every role.");
			return false;
		default:
			return true;
	}
}

/* Refuses a non-empty rl_redis.password from a database or role setting. */
static bool
check_password(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0' || rl_secret_source_ok(source))
		return true;
	GUC_check_errhint("Set rl_redis.password in postgresql.conf (or with ALTER SYSTEM), or use rl_redis.password_file.");
	return false;
}

/* The same for rl_redis.sentinel_password. */
static bool
check_sentinel_password(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0' || rl_secret_source_ok(source))
		return true;
	GUC_check_errhint("Set rl_redis.sentinel_password in postgresql.conf (or with ALTER SYSTEM).");
	return false;
}

/*
 * Fills err (errsize bytes) with why the password file cannot be used,
 * what (a clause about "the file"), and with log puts the file's path in
 * the server log only: the path is hidden from ordinary roles, and err may
 * reach any role that calls.
 */
static void
rl_password_file_failed(const char *what, bool log, char *err, size_t errsize)
{
	static TimestampTz last_logged = 0;
	TimestampTz now;

	snprintf(err, errsize, "rl_redis.password_file: %s", what);
	if (!log)
		return;
	/* at most one line a minute: rl_redis_ping() starts a new outage */
	now = GetCurrentTimestamp();
	if (last_logged != 0 && !TimestampDifferenceExceeds(last_logged, now, 60000))
		return;
	last_logged = now;
	ereport(LOG_SERVER_ONLY,
			(errmsg("rl_redis.password_file \"%s\": %s", rl_password_file, what)));
}

/*
 * Fills buf with the password to send: for a sentinel,
 * rl_redis.sentinel_password; else rl_redis.password when set, else the
 * first line (without its line end) of the file rl_redis.password_file
 * names, else "". Returns false with a message in err when a password
 * setting is set but the library was not preloaded (every role could read
 * it until the library was loaded), when the file cannot be read, is not a
 * plain file, is group or world accessible (like libpq's passfile), or its
 * first line is empty, or when the password is longer than size - 1
 * bytes. err never holds a secret or the file's path, and hint is set to
 * the advice for the failure (or RL_HINT_NONE); with log, a failure
 * of the file is also written, with the path, to the server log (the
 * caller logs the failure that starts an outage only, so that calls cannot
 * flood the log). It is called while connecting: it raises only when that
 * log line cannot be written, and the file is closed by then.
 */
bool
rl_read_password(bool sentinel, bool log, char *buf, size_t size, char *err,
				 size_t errsize, RlHint *hint)
{
	const char *name = sentinel ? "rl_redis.sentinel_password" : "rl_redis.password";
	const char *value = sentinel ? rl_sentinel_password : rl_password;
	const char *path = rl_password_file;
	char		what[128];
	struct stat st;
	size_t		len = 0;
	int			fd;
	bool		ok = false;

	if (errsize > 0)
		err[0] = '\0';
	*hint = RL_HINT_NONE;
	if (size == 0)
	{
		snprintf(err, errsize, "no room for the password");
		return false;
	}
	buf[0] = '\0';

	if (value != NULL && value[0] != '\0')
	{
		if (!secrets_hidden)
		{
			snprintf(err, errsize,
					 "%s is not used without rl_redis in shared_preload_libraries",
					 name);
			*hint = sentinel ? RL_HINT_PRELOAD : RL_HINT_PRELOAD_OR_FILE;
			return false;
		}
		if (strlen(value) >= size)
		{
			snprintf(err, errsize, "%s is longer than %zu bytes", name, size - 1);
			return false;
		}
		strcpy(buf, value);
		return true;
	}
	if (sentinel || path == NULL || path[0] == '\0')
		return true;

	/* O_NONBLOCK: a FIFO must not hold the backend; it is refused below */
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0);
	if (fd < 0)
	{
		snprintf(what, sizeof(what), "could not open the file: %s", strerror(errno));
		rl_password_file_failed(what, log, err, errsize);
		return false;
	}
	if (fstat(fd, &st) != 0)
	{
		snprintf(what, sizeof(what), "could not stat the file: %s", strerror(errno));
		goto done;
	}
	if (!S_ISREG(st.st_mode))
	{
		snprintf(what, sizeof(what), "the file is not a plain file");
		goto done;
	}
	if (st.st_mode & (S_IRWXG | S_IRWXO))
	{
		snprintf(what, sizeof(what),
				 "the file has group or world access; permissions should be u=rw (0600) or less");
		goto done;
	}

	/* read up to the first newline, into buf directly (no other copy) */
	for (;;)
	{
		ssize_t		n;
		char	   *nl;

		if (len == size - 1)
		{
			char		c;

			/* buf is full: the line must end here */
			do
				n = read(fd, &c, 1);
			while (n < 0 && errno == EINTR);
			if (n < 0)
				goto read_failed;
			if (n == 1 && c != '\n')
			{
				snprintf(what, sizeof(what),
						 "the password in the file is longer than %zu bytes", size - 1);
				goto done;
			}
			break;
		}
		n = read(fd, buf + len, size - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			goto read_failed;
		if (n == 0)
			break;
		nl = memchr(buf + len, '\n', n);
		if (nl != NULL)
		{
			len = nl - buf;
			break;
		}
		len += n;
	}
	buf[len] = '\0';
	while (len > 0 && buf[len - 1] == '\r')
		buf[--len] = '\0';
	if (memchr(buf, '\0', len) != NULL)
		snprintf(what, sizeof(what), "the file contains a zero byte");
	else if (len == 0)
		snprintf(what, sizeof(what), "the file is empty");
	else
		ok = true;
	goto done;

read_failed:
	snprintf(what, sizeof(what), "could not read the file: %s", strerror(errno));

done:
	close(fd);
	if (!ok)
	{
		explicit_bzero(buf, size);
		rl_password_file_failed(what, log, err, errsize);
	}
	return ok;
}

/*
 * Parses one "host:port" of rl_redis.nodes (len bytes at s; an IPv6 address
 * in brackets, "[::1]:6379") into host (RL_ADDRESS_LEN bytes) and *port;
 * false when it is not of that form.
 */
bool
rl_parse_node(const char *s, size_t len, char *host, int *port)
{
	const char *colon = NULL;
	size_t		hlen;
	size_t		plen;
	size_t		i;
	char		num[8];
	char	   *end;
	long		p;

	while (len > 0 && (s[0] == ' ' || s[0] == '\t'))
		s++, len--;
	while (len > 0 && (s[len - 1] == ' ' || s[len - 1] == '\t'))
		len--;
	for (hlen = len; hlen > 0; hlen--)
		if (s[hlen - 1] == ':')
		{
			colon = s + hlen - 1;
			break;
		}
	if (colon == NULL || colon == s)
		return false;
	hlen = colon - s;
	plen = len - hlen - 1;
	if (s[0] == '[')
	{
		if (hlen < 3 || s[hlen - 1] != ']')
			return false;
		s++;
		hlen -= 2;
	}
	else if (memchr(s, ':', hlen) != NULL || memchr(s, ']', hlen) != NULL)
		return false;			/* an IPv6 address needs its brackets */
	if (hlen >= RL_ADDRESS_LEN - 8 || plen == 0 || plen >= sizeof(num))
		return false;
	for (i = 0; i < hlen; i++)
		if ((unsigned char) s[i] <= ' ' || s[i] == ',' || s[i] == '[')
			return false;
	memcpy(num, colon + 1, plen);
	num[plen] = '\0';
	errno = 0;
	p = strtol(num, &end, 10);
	if (*end != '\0' || errno != 0 || p < 1 || p > 65535)
		return false;
	memcpy(host, s, hlen);
	host[hlen] = '\0';
	*port = (int) p;
	return true;
}

/*
 * Parses the "<host>:<port>" of a node a server named (a MOVED or ASK
 * redirection): an empty host is default_host, the server's own (Redis says
 * ":<port>" when it does not know its address). A Unix socket path is
 * refused: a server may send us to any TCP address, as to any client, but
 * not to a socket of this machine.
 */
bool
rl_parse_redirect_node(const char *s, const char *default_host, char *host,
					   int *port)
{
	if (s[0] == ':')
	{
		char		buf[16];

		snprintf(buf, sizeof(buf), "h%s", s);
		if (strlen(s) >= sizeof(buf) - 1 || !rl_parse_node(buf, strlen(buf), host, port))
			return false;
		strlcpy(host, default_host, RL_ADDRESS_LEN);
		return true;
	}
	return rl_parse_node(s, strlen(s), host, port) && host[0] != '/';
}

/*
 * Fills seeds (RL_MAX_SEEDS entries) with rl_redis.nodes, or host and port
 * when it is empty; returns how many. The check hook made sure they parse.
 */
int
rl_seeds(RlSeed *seeds)
{
	const char *p = rl_nodes;
	int			n = 0;

	if (p == NULL || p[0] == '\0')
	{
		strlcpy(seeds[0].host, rl_host, RL_ADDRESS_LEN);
		seeds[0].port = rl_port;
		return 1;
	}
	while (n < RL_MAX_SEEDS)
	{
		const char *comma = strchr(p, ',');
		size_t		len = comma ? (size_t) (comma - p) : strlen(p);

		if (rl_parse_node(p, len, seeds[n].host, &seeds[n].port))
			n++;
		if (comma == NULL)
			break;
		p = comma + 1;
	}
	return n;
}

/* Accepts rl_redis.nodes: empty, or "host:port" items separated by commas. */
static bool
check_nodes(char **newval, void **extra, GucSource source)
{
	const char *p = *newval;
	int			count = 0;

	if (p == NULL || p[0] == '\0')
		return true;
	for (;;)
	{
		const char *comma = strchr(p, ',');
		size_t		len = comma ? (size_t) (comma - p) : strlen(p);
		char		host[RL_ADDRESS_LEN];
		int			port;

		if (!rl_parse_node(p, len, host, &port))
		{
			GUC_check_errdetail("\"%.*s\" is not of the form host:port.", (int) len, p);
			return false;
		}
		if (++count > RL_MAX_SEEDS)
		{
			GUC_check_errdetail("rl_redis.nodes may name at most %d nodes.", RL_MAX_SEEDS);
			return false;
		}
		if (comma == NULL)
			return true;
		p = comma + 1;
	}
}

/* Same as assign_connection_string, for rl_redis.mode. */
static void
assign_connection_enum(int newval, void *extra)
{
	rl_connection_settings_changed = true;
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
							   check_password, assign_connection_string, NULL);

	/*
	 * Until the library is loaded, rl_redis.password from postgresql.conf is
	 * a placeholder that SHOW, current_setting and pg_settings show to every
	 * role: only preloading keeps it hidden from the start, and without
	 * preloading rl_read_password refuses it.
	 */
	secrets_hidden = process_shared_preload_libraries_in_progress;
	if (!secrets_hidden && rl_password != NULL && rl_password[0] != '\0')
		ereport(WARNING,
				(errmsg("rl_redis.password is not used because the rl_redis library is not in shared_preload_libraries"),
				 errdetail("Every role could read the setting before the library was loaded."),
				 errhint("Add rl_redis to shared_preload_libraries, or use rl_redis.password_file (without preloading, every role can read its path, not the password).")));

	DefineCustomStringVariable("rl_redis.password_file",
							   "File whose first line is the Redis password sent with AUTH.",
							   "Used when rl_redis.password is empty. The file must not be group or world accessible (0600); a relative path is taken from the data directory.",
							   &rl_password_file,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY,
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

	DefineCustomEnumVariable("rl_redis.mode",
							 "How the Redis servers are organised: standalone, cluster or sentinel.",
							 "standalone: one server, rl_redis.host and rl_redis.port; cluster: a Redis Cluster whose nodes rl_redis.nodes names; sentinel: the master that the sentinels in rl_redis.nodes report for rl_redis.sentinel_master.",
							 &rl_mode,
							 RL_MODE_STANDALONE,
							 mode_options,
							 PGC_SUSET,
							 0,
							 NULL, assign_connection_enum, NULL);

	DefineCustomStringVariable("rl_redis.nodes",
							   "Comma-separated host:port list: cluster nodes to learn the slot map from, or the sentinels.",
							   "Empty uses rl_redis.host and rl_redis.port as the one seed.",
							   &rl_nodes,
							   "",
							   PGC_SUSET,
							   0,
							   check_nodes, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.sentinel_master",
							   "Name of the master the sentinels are asked about (rl_redis.mode = sentinel).",
							   NULL,
							   &rl_sentinel_master,
							   "",
							   PGC_SUSET,
							   0,
							   NULL, assign_connection_string, NULL);

	DefineCustomStringVariable("rl_redis.sentinel_password",
							   "Password sent with AUTH to the sentinels.",
							   "Empty means no AUTH to the sentinels; the Redis nodes get rl_redis.password.",
							   &rl_sentinel_password,
							   "",
							   PGC_SUSET,
							   GUC_SUPERUSER_ONLY | GUC_NO_SHOW_ALL,
							   check_sentinel_password, assign_connection_string, NULL);

	if (!secrets_hidden &&
		rl_sentinel_password != NULL && rl_sentinel_password[0] != '\0')
		ereport(WARNING,
				(errmsg("rl_redis.sentinel_password is not used because the rl_redis library is not in shared_preload_libraries"),
				 errdetail("Every role could read the setting before the library was loaded."),
				 errhint("Add rl_redis to shared_preload_libraries.")));

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

	DefineCustomIntVariable("rl_redis.idle_timeout",
							"Time after which a session's idle Redis connections are closed.",
							"Counted from the end of the last transaction that sent something to Redis; zero keeps them open.",
							&rl_idle_timeout,
							0, 0, INT_MAX,
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

	DefineCustomBoolVariable("rl_redis.stats",
							 "Whether decisions are counted in the rl_redis_stats view.",
							 NULL,
							 &rl_stats,
							 true,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	DefineCustomEnumVariable("rl_redis.transport",
							 "How a session's script calls reach Redis: on its own connection, or through the rl_redis worker's shared, pipelined connection.",
							 "shared needs the library in shared_preload_libraries and rl_redis.mode standalone; otherwise, and when the shared queue is full or the worker is not running, a call uses the session's own connection.",
							 &rl_transport,
							 RL_TRANSPORT_BACKEND,
							 transport_options,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	/*
	 * The queue is made at server start, when the library is preloaded; a
	 * server-start setting cannot be defined later, so a library loaded
	 * later defines it as reloadable (and without effect: there is no
	 * queue), which keeps a value in postgresql.conf from being warned
	 * about by every session.
	 */
	DefineCustomIntVariable("rl_redis.shared_queue_size",
							"The number of calls the shared queue of rl_redis.transport = shared holds at once.",
							"Each queue entry takes about 13 kB of shared memory, taken when the shared transport is first used. Only with the library in shared_preload_libraries, read at server start.",
							&rl_shared_queue_size,
							256, 16, 8192,
							process_shared_preload_libraries_in_progress ? PGC_POSTMASTER : PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomBoolVariable("rl_redis.deny_cache",
							 "Whether denials are remembered in the backend until their retry time, so that calls for a denied identity are denied without Redis.",
							 "Only with the library in shared_preload_libraries. Refunds and resets made on other servers are not seen: they can cause denials until the remembered retry time.",
							 &rl_deny_cache,
							 false,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	DefineCustomBoolVariable("rl_redis.track_denials",
							 "Whether denials of policies are counted per identity in Redis, for rl_top_denied.",
							 "Each denied call of a policy costs one more Redis call.",
							 &rl_track_denials,
							 false,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

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

	DefineCustomIntVariable("rl_redis.max_lease",
							"Longest lease a concurrency slot may have.",
							"A slot whose holder never gives it back (a crashed backend) stays taken this long at most.",
							&rl_max_lease,
							3600000, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.sliding_max_lim",
							"Largest lim of a sliding window log.",
							"The log keeps one Redis sorted-set entry (about 110 bytes) per unit in the window.",
							&rl_sliding_max_lim,
							10000, 1, RL_MAX_SLIDING_LIM,
							PGC_SUSET,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.max_identity_bytes",
							"Longest identity, in bytes, that a decision, slot, refund, reset or guard takes.",
							"A longer identity is refused before anything is sent to Redis; each identity is part of its Redis keys.",
							&rl_max_identity_bytes,
							RL_DEFAULT_IDENTITY_BYTES, 1, RL_MAX_IDENTITY_BYTES,
							PGC_SUSET,
							GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	DefineCustomRealVariable("rl_redis.test_clock_ms",
							 "Fixed clock for tests, in milliseconds since the epoch.",
							 "Zero (the default) uses the Redis server's clock. For tests only.",
							 &rl_test_clock_ms,
							 0, 0, RL_MAX_TEST_CLOCK_MS,
							 PGC_SUSET,
							 GUC_NOT_IN_SAMPLE,
							 NULL, NULL, NULL);

	/*
	 * Timers that tests shorten so as not to wait them out. Each default is
	 * the production value and also the most allowed: these settings can
	 * make nothing wait longer than it does without them.
	 */
	DefineCustomIntVariable("rl_redis.xact_end_budget",
							"For tests: the most a transaction end (or a backend's exit) waits on Redis for slot releases and refunds.",
							"A transaction end waits at most rl_redis.command_timeout too, and what it did not send goes with the session's next call; what an exiting backend did not send is not sent.",
							&rl_xact_end_budget,
							RL_XACT_END_BUDGET_MS, 1, RL_XACT_END_BUDGET_MS,
							PGC_SUSET,
							GUC_NOT_IN_SAMPLE | GUC_UNIT_MS,
							NULL, NULL, NULL);

	/*
	 * The worker is registered, with this restart time, when the library is
	 * preloaded (at server start, or when the shared transport is first
	 * used); loaded later, there is no worker and the setting is defined as
	 * reloadable (and without effect), as rl_redis.shared_queue_size is.
	 */
	DefineCustomIntVariable("rl_redis.worker_restart_interval",
							"For tests: how soon the postmaster starts the rl_redis worker again after it exited.",
							"Zero starts it at once. Only with the library in shared_preload_libraries, read at server start.",
							&rl_worker_restart_interval,
							RL_WORKER_RESTART_S, 0, RL_WORKER_RESTART_S,
							process_shared_preload_libraries_in_progress ? PGC_POSTMASTER : PGC_SIGHUP,
							GUC_NOT_IN_SAMPLE | GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.sentinel_recheck_interval",
							"For tests: how long after they were last asked the sentinels are asked again which server is the master.",
							"Only with rl_redis.mode = sentinel.",
							&rl_sentinel_recheck_interval,
							RL_SENTINEL_RECHECK_MS, 1, RL_SENTINEL_RECHECK_MS,
							PGC_SUSET,
							GUC_NOT_IN_SAMPLE | GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("rl_redis.slot_map_refresh_interval",
							"For tests: the least time between two fetches of the Redis Cluster's slot map.",
							"Only with rl_redis.mode = cluster.",
							&rl_slot_map_refresh_interval,
							RL_SLOT_MAP_REFRESH_MS, 1, RL_SLOT_MAP_REFRESH_MS,
							PGC_SUSET,
							GUC_NOT_IN_SAMPLE | GUC_UNIT_MS,
							NULL, NULL, NULL);

	MarkGUCPrefixReserved("rl_redis");
}
