"""Tenants: named by a keyed hash of their credential, never by the key itself; /metrics stays small
whoever sends what; with --isolate-tenants only the credential picks a tenant's cache, and the
tenant and the client's cache_salt are joined without ambiguity."""
from __future__ import annotations

import re

import httpx
import pytest

from minikv.serve import Server, parse_metrics
from minikv.serve.metrics import MAX_TENANT_LABELS, ServerMetrics
from minikv.serve.tenants import Tenants

from test_serve import HANG_S, MODEL, engine, prompt_ids

HTTP = httpx.Client(timeout=HANG_S)


def ask(server, key: str | None, **body) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    r = HTTP.post(server.url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def cached(server, key: str | None, **body) -> int:
    return ask(server, key, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def isolated():
    with Server(engine(), served_name=MODEL, isolate_tenants=True) as s:
        yield s


@pytest.fixture(scope="module")
def shared():
    with Server(engine(schedule_policy="vtc"), served_name=MODEL) as s:
        yield s


def test_metrics_label_tenants_by_a_keyed_hash_never_by_the_api_key(shared):
    key = "sk-alice-0123456789abcdef"
    ask(shared, key, prompt=[4, 5, 6])
    text = HTTP.get(shared.url + "/metrics").text
    assert key not in text and "alice" not in text
    labels = set(re.findall(r'tenant="([^"]*)"', text))
    assert shared.tenant_id(key) in labels
    assert all(re.fullmatch(r"t-[0-9a-f]{16}|anonymous|other", t) for t in labels), labels


def test_a_tenant_id_is_stable_for_one_server_key_and_differs_between_keys():
    assert Tenants("k1").id_of("sk-alice") == Tenants("k1").id_of("sk-alice") != Tenants("k2").id_of("sk-alice")
    assert Tenants("k1").id_of("sk-alice") != Tenants("k1").id_of("sk-bob")
    assert Tenants().id_of("sk-alice") != Tenants().id_of("sk-alice")  # no key given: a random one per server


def test_metrics_stay_small_whatever_users_send(shared):
    size_before = len(HTTP.get(shared.url + "/metrics").content)
    for i in range(40):  # 40 distinct 128 KB `user` strings
        ask(shared, None, prompt=[4, 5], user=f"{i:03d}" + "u" * (128 * 1024))
    size_after = len(HTTP.get(shared.url + "/metrics").content)
    assert size_after < size_before + 40 * 300, (size_before, size_after)  # a few short lines per tenant


def test_at_most_64_tenants_get_their_own_label_the_rest_count_as_other():
    m = ServerMetrics()
    for i in range(200):
        m.tokens_generated(f"t-{i:016x}", 2)
    m.tokens_generated("t-" + "x" * 10_000, 1)  # a long name is cut
    labels = set(m.generation_tokens)
    assert len(labels) == MAX_TENANT_LABELS + 1 and "other" in labels
    assert m.generation_tokens["other"] == 2 * (200 - MAX_TENANT_LABELS) + 1
    assert sum(m.generation_tokens.values()) == 401  # nothing is lost, only aggregated
    assert m.generation_tokens["t-0000000000000000"] == 2  # the first ones keep theirs


def test_the_metric_names_stay_the_public_ones(shared):
    ask(shared, "sk-carol", prompt=[4, 5, 6])  # a request of its own: the per-tenant series exist once one was served
    m = parse_metrics(HTTP.get(shared.url + "/metrics").text)
    names = {k.split("{")[0] for k in m}
    assert {"minikv:prompt_tokens_total", "minikv:generation_tokens_total", "minikv:tenant_service_tokens",
            "minikv:request_success_total", "minikv:kv_cache_usage_perc"} <= names


def test_with_isolation_a_client_cannot_reach_another_tenants_cache_by_naming_it_in_user(isolated):
    body = {"prompt": prompt_ids(31, 64), "temperature": 0}
    cached(isolated, "alice", **body)
    assert cached(isolated, "alice", **body) == 48  # alice's prefix is cached (3 whole blocks of 16)
    assert cached(isolated, "mallory", user="alice", **body) == 0  # `user` picks no tenant
    assert cached(isolated, "eve", user=isolated.tenant_id("alice"), **body) == 0  # nor does her id
    assert cached(isolated, "mallory", user="alice", **body) == 48  # mallory's own cache, as for anyone


def test_with_isolation_tenant_and_cache_salt_are_joined_without_ambiguity(isolated):
    body = {"prompt": prompt_ids(32, 64), "temperature": 0}
    cached(isolated, "a", cache_salt="b/c", **body)
    assert cached(isolated, "a", cache_salt="b/c", **body) == 48
    assert cached(isolated, "a/b", cache_salt="c", **body) == 0
    assert cached(isolated, "a", cache_salt="b", **body) == 0
    assert cached(isolated, "a", **body) == 0
    t = Tenants("k", isolate=True)
    pairs = [("a", "b/c"), ("a/b", "c"), ("a", None), ("a", ""), ("1:a", None), ("1", "a")]
    salts = [t.cache_salt(tenant, salt) for tenant, salt in pairs]
    assert len(set(salts)) == len(pairs)


def test_without_isolation_the_same_prompt_is_shared_between_tenants(shared):
    body = {"prompt": prompt_ids(33, 64), "temperature": 0}
    cached(shared, "alice", **body)
    assert cached(shared, "bob", **body) == 48  # one cache for all: the operator chose it
    assert cached(shared, "bob", cache_salt="s", **body) == 0  # a client may still salt its own prompts
