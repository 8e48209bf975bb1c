/* rl_redis--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.6'" to load this file. \quit
