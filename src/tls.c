/*
 * tls.c
 *	  TLS for one Redis connection, through OpenSSL on its non-blocking
 *	  socket.
 *
 * Nothing here waits: a handshake step, read or write that cannot go on
 * returns RL_IO_WAIT and says what to wait for, and the transport waits for
 * it (with interrupts serviced) and calls again.
 */
#include "postgres.h"

#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "storage/latch.h"

#include "rl_redis.h"

/* Describes the last OpenSSL error (or the certificate check's) in buf. */
static void
rl_tls_error(RlTls *tls, char *buf, size_t size)
{
	unsigned long code = ERR_get_error();

	if (tls->ssl && SSL_get_verify_result(tls->ssl) != X509_V_OK)
		snprintf(buf, size, "certificate verify failed: %s",
				 X509_verify_cert_error_string(SSL_get_verify_result(tls->ssl)));
	else if (code != 0)
		ERR_error_string_n(code, buf, size);
	else
		snprintf(buf, size, "%s", errno ? strerror(errno) : "connection closed");
	ERR_clear_error();
}

/*
 * Turns an OpenSSL result r of an I/O call into RL_IO_WAIT (with *want set
 * to what to wait for), 0 for a closed connection, or -1 (with errbuf).
 */
static ssize_t
rl_tls_result(RlTls *tls, int r, uint32 *want, char *errbuf, size_t errsize)
{
	switch (SSL_get_error(tls->ssl, r))
	{
		case SSL_ERROR_WANT_READ:
			*want = WL_SOCKET_READABLE;
			return RL_IO_WAIT;
		case SSL_ERROR_WANT_WRITE:
			*want = WL_SOCKET_WRITEABLE;
			return RL_IO_WAIT;
		case SSL_ERROR_ZERO_RETURN:
			return 0;
		case SSL_ERROR_SYSCALL:
			if (ERR_peek_error() == 0 && errno == 0)
				return 0;		/* EOF without close_notify */
			/* FALLTHROUGH */
		default:
			rl_tls_error(tls, errbuf, errsize);
			return -1;
	}
}

/*
 * Sets up TLS on the connected socket sock of server: the server's
 * certificate is checked against rl_redis.tls_ca_file (or the system's CAs)
 * and its name against rl_redis.tls_server_name (or host, the name the
 * connection was made to). False,
 * with failure filled in, on error; rl_tls_free frees what was made.
 */
bool
rl_tls_setup(RlTls *tls, pgsocket sock, const char *host, const char *server,
			 RlFailure *failure)
{
	const char *name = rl_tls_server_name[0] ? rl_tls_server_name : host;
	unsigned char addr[sizeof(struct in6_addr)];
	bool		is_ip = inet_pton(AF_INET, name, addr) == 1 ||
		inet_pton(AF_INET6, name, addr) == 1;
	char		errbuf[256];

	ERR_clear_error();
	tls->ctx = SSL_CTX_new(TLS_client_method());
	if (tls->ctx == NULL)
		goto fail;
	SSL_CTX_set_min_proto_version(tls->ctx, TLS1_2_VERSION);
	SSL_CTX_set_mode(tls->ctx, SSL_MODE_ENABLE_PARTIAL_WRITE |
					 SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
	SSL_CTX_set_verify(tls->ctx, SSL_VERIFY_PEER, NULL);
	if (rl_tls_ca_file[0] != '\0')
	{
		if (SSL_CTX_load_verify_locations(tls->ctx, rl_tls_ca_file, NULL) != 1)
		{
			rl_tls_error(tls, errbuf, sizeof(errbuf));
			rl_fail(failure, RL_FAILURE_CONFIG, ERRCODE_CONFIG_FILE_ERROR,
					RL_HINT_NONE, errbuf,
					"could not load rl_redis.tls_ca_file");
			return false;
		}
	}
	else if (SSL_CTX_set_default_verify_paths(tls->ctx) != 1)
		goto fail;
	if (rl_tls_cert_file[0] != '\0')
	{
		if (SSL_CTX_use_certificate_chain_file(tls->ctx, rl_tls_cert_file) != 1 ||
			SSL_CTX_use_PrivateKey_file(tls->ctx,
										rl_tls_key_file[0] ? rl_tls_key_file : rl_tls_cert_file,
										SSL_FILETYPE_PEM) != 1 ||
			SSL_CTX_check_private_key(tls->ctx) != 1)
		{
			rl_tls_error(tls, errbuf, sizeof(errbuf));
			rl_fail(failure, RL_FAILURE_CONFIG, ERRCODE_CONFIG_FILE_ERROR,
					RL_HINT_NONE, errbuf,
					"could not load the client certificate (rl_redis.tls_cert_file, rl_redis.tls_key_file)");
			return false;
		}
	}

	tls->ssl = SSL_new(tls->ctx);
	if (tls->ssl == NULL || SSL_set_fd(tls->ssl, sock) != 1)
		goto fail;
	if (!is_ip)
		SSL_set_tlsext_host_name(tls->ssl, name);
	if (is_ip ?
		X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(tls->ssl), name) != 1 :
		SSL_set1_host(tls->ssl, name) != 1)
		goto fail;
	return true;

fail:
	rl_tls_error(tls, errbuf, sizeof(errbuf));
	rl_fail(failure, RL_FAILURE_CONFIG,
			ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION, RL_HINT_NONE,
			errbuf, "could not set up TLS for Redis at %s", server);
	return false;
}

/*
 * Takes the TLS handshake as far as it goes without waiting: 1 when it is
 * complete, RL_IO_WAIT (with *want) when it must wait, -1 (with errbuf) when
 * it failed.
 */
int
rl_tls_handshake(RlTls *tls, uint32 *want, char *errbuf, size_t errsize)
{
	int			r;
	ssize_t		n;

	ERR_clear_error();
	errno = 0;
	r = SSL_connect(tls->ssl);
	if (r == 1)
		return 1;
	n = rl_tls_result(tls, r, want, errbuf, errsize);
	if (n == 0)
		snprintf(errbuf, errsize, "the server closed the connection");
	return n == RL_IO_WAIT ? RL_IO_WAIT : -1;
}

/*
 * Writes up to len bytes: returns how many, RL_IO_WAIT (with *want), or -1
 * (with errbuf).
 */
ssize_t
rl_tls_write(RlTls *tls, const char *buf, size_t len, uint32 *want,
			 char *errbuf, size_t errsize)
{
	ssize_t		n;
	int			r;

	ERR_clear_error();
	errno = 0;
	r = SSL_write(tls->ssl, buf, (int) Min(len, (size_t) INT_MAX));
	if (r > 0)
		return r;
	n = rl_tls_result(tls, r, want, errbuf, errsize);
	if (n == 0)
		snprintf(errbuf, errsize, "the server closed the connection");
	return n == 0 ? -1 : n;
}

/*
 * Reads up to len bytes: returns how many, 0 when the server closed the
 * connection, RL_IO_WAIT (with *want), or -1 (with errbuf).
 */
ssize_t
rl_tls_read(RlTls *tls, char *buf, size_t len, uint32 *want, char *errbuf,
			size_t errsize)
{
	int			r;

	ERR_clear_error();
	errno = 0;
	r = SSL_read(tls->ssl, buf, (int) Min(len, (size_t) INT_MAX));
	if (r > 0)
		return r;
	return rl_tls_result(tls, r, want, errbuf, errsize);
}

/*
 * True when an idle TLS connection is still usable: the server has not
 * closed it (TLS records such as session tickets may arrive unasked).
 */
bool
rl_tls_alive(RlTls *tls)
{
	char		c;
	int			n;

	ERR_clear_error();
	n = SSL_peek(tls->ssl, &c, 1);
	if (n <= 0 && SSL_get_error(tls->ssl, n) == SSL_ERROR_WANT_READ)
	{
		ERR_clear_error();
		return true;
	}
	ERR_clear_error();
	return false;
}

/* Frees the TLS state of a connection. */
void
rl_tls_free(RlTls *tls)
{
	if (tls->ssl)
		SSL_free(tls->ssl);
	tls->ssl = NULL;
	if (tls->ctx)
		SSL_CTX_free(tls->ctx);
	tls->ctx = NULL;
}
