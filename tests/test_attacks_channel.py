"""Attacks on the secure channel and the session: each against a real appliance on loopback, each followed by a
legitimate client that still works.

- sessions over a None channel and over Sign when only SignAndEncrypt is configured;
- a CreateSession whose ClientCertificate is omitted or borrowed from another client;
- stolen and guessed authentication tokens, and re-activation by the same certificate as another user;
- an application certificate whose SubjectAltName URI differs from the ApplicationUri it claims;
- a request altered on the wire after it was signed and encrypted.
"""
from __future__ import annotations

import os

import pytest
from asyncua import ua

from appliance.client import connect
from appliance.users import UserStore
from attack_tools import (
    SAMPLE, close, infer_once, legit_infer, new_client, open_channel, refusal, run_node_client, start_appliance,
    status_of, tamper_create_session,
)
from certificates import make_test_certificate
from uaclient import call, floats, run, status_name
from uaserver.asyncua_internals import external_sessions

V = ua.VariantType


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = start_appliance(tmp_path_factory.mktemp("attacks_channel"))
    a.scada = a.issue("scada", "monitor")
    UserStore(a.state_dir).add("maint", "engineer", "maint-password-1")
    yield a
    a.stop()


def served(app) -> int:
    return int(app.app.services["affine"].request_count)


def test_none_channel_gets_no_session_and_no_call(app):
    async def go():
        before = served(app)
        client = await new_client(app.endpoint, None, None)
        exc = await refusal(client.connect())
        await close(client)
        assert status_of(exc) == "BadSecurityPolicyRejected", exc
        # Skip the session and send a Call straight over the None channel: refused before anything runs.
        client = await new_client(app.endpoint, None, None)
        await open_channel(client)
        try:
            endpoints = await client.uaclient.get_endpoints(ua.GetEndpointsParameters(EndpointUrl=app.endpoint))
            modes = {e.SecurityMode for e in endpoints}
            assert modes == {ua.MessageSecurityMode.SignAndEncrypt}  # discovery works; None is never offered
            request = ua.CallMethodRequest(ObjectId=ua.NodeId(1, 0), MethodId=ua.NodeId(2, 0),
                                           InputArguments=[floats(SAMPLE)])
            exc = await refusal(client.uaclient.call([request]))
            assert status_of(exc) == "BadSecurityPolicyRejected", exc
            exc = await refusal(client.create_session())
            assert status_of(exc) == "BadSecurityPolicyRejected", exc
        finally:
            await close(client)
        assert served(app) == before
        await legit_infer(app)
    run(go())


def test_sign_only_channel_refused_when_only_sign_and_encrypt_is_configured(app):
    async def go():
        cert, key = app.operator
        # skip discovery (Sign is not offered) and ask for it anyway
        client = await new_client(app.endpoint, cert, key, mode="Sign", server_certificate=app.pki.layout.own_cert_der)
        exc = await refusal(client.connect())
        await close(client)
        assert status_of(exc) == "BadSecurityPolicyRejected", exc
        await legit_infer(app)
    run(go())


@pytest.mark.parametrize("forged", ["omitted", "other client's"])
def test_create_session_certificate_must_be_the_channel_certificate(app, forged):
    async def go():
        cert, key = app.operator
        other = app.scada[0].read_bytes() if forged != "omitted" else None
        client = await new_client(app.endpoint, cert, key)
        tamper_create_session(client, other)
        exc = await refusal(client.connect())
        await close(client)
        assert status_of(exc) == "BadSecurityChecksFailed", exc
        await legit_infer(app)
    run(go())


def test_tokens_are_random_and_a_stolen_token_is_useless_on_another_channel(app):
    async def go():
        victim = await connect(app.endpoint, *app.operator)
        second = await connect(app.endpoint, *app.operator)
        try:
            tokens = [c.uaclient.protocol.authentication_token for c in (victim, second)]
            for t in tokens:
                assert t.NodeIdType == ua.NodeIdType.ByteString and len(t.Identifier) >= 16, t
            assert tokens[0] != tokens[1]
            # not a counter: the two tokens share no long common prefix
            assert len(os.path.commonprefix([tokens[0].Identifier, tokens[1].Identifier])) < 8
            # the session ids the server holds are just as random, and differ from the tokens
            live = external_sessions(app.app.ua.server)
            ids = [s.session_id for s in live]
            assert len(live) >= 2 and len(set(ids)) == len(ids)
            for s in live:
                assert s.session_id.NodeIdType == ua.NodeIdType.ByteString and len(s.session_id.Identifier) >= 16
                assert s.session_id != s.auth_token
            stolen = tokens[0]

            guesses = {
                "stolen, other certificate": stolen,
                "random guess": ua.NodeId(os.urandom(32), 0, ua.NodeIdType.ByteString),
                "sequential guess": ua.NodeId(1001, 1),
            }
            for label, token in guesses.items():
                attacker = await new_client(app.endpoint, *app.scada)  # a trusted certificate, but not the victim's
                await open_channel(attacker)
                try:
                    attacker.uaclient.protocol.authentication_token = token
                    attacker._server_nonce = victim._server_nonce
                    exc = await refusal(attacker.activate_session(certificate=None))
                    assert status_of(exc) == "BadSessionIdInvalid", (label, exc)
                    # and nothing else on that channel works under the victim's token
                    exc = await refusal(attacker.nodes.server_state.read_value())
                    assert status_of(exc) == "BadUserAccessDenied", (label, exc)
                finally:
                    await close(attacker)
            # the stolen token over a None channel
            attacker = await new_client(app.endpoint, None, None)
            await open_channel(attacker)
            try:
                attacker.uaclient.protocol.authentication_token = stolen
                exc = await refusal(attacker.activate_session())
                assert status_of(exc) == "BadSecurityPolicyRejected", exc
            finally:
                await close(attacker)
            # the victim's session is untouched
            assert status_name(await infer_once(victim)) == "Good"
        finally:
            await close(victim)
            await close(second)
    run(go())


def test_reactivation_by_same_certificate_as_another_user_fails_and_leaves_the_session(app):
    async def go():
        victim = await connect(app.endpoint, *app.operator)  # X509 identity plc1 -> operator
        try:
            attacker = await new_client(app.endpoint, *app.operator)  # same application certificate
            await open_channel(attacker)
            try:
                attacker.uaclient.protocol.authentication_token = victim.uaclient.protocol.authentication_token
                attacker._server_nonce = victim._server_nonce
                exc = await refusal(attacker.activate_session(username="maint", password="maint-password-1"))
                assert status_of(exc) == "BadUserAccessDenied", exc
            finally:
                await close(attacker)
            # still the victim's, still operator (not the engineer the attacker tried to become)
            assert status_name(await infer_once(victim)) == "Good"
            r = await call(victim, "", "ReloadModel", [ua.Variant("affine", V.String)])
            assert status_name(r) == "BadUserAccessDenied"
        finally:
            await close(victim)
        await legit_infer(app)
    run(go())


def test_certificate_uri_must_match_application_uri(app):
    async def go():
        cert, key = app.operator
        client = await new_client(app.endpoint, cert, key, application_uri="urn:somewhere:else")
        exc = await refusal(client.connect())
        await close(client)
        assert status_of(exc) == "BadCertificateUriInvalid", exc
        await legit_infer(app)
    run(go())


def test_untrusted_channel_certificate_with_a_borrowed_trusted_one_in_create_session(app, tmp_path):
    """A rogue certificate opens the channel and claims a trusted client's certificate in CreateSession."""
    async def go():
        rogue_cert, rogue_key = make_test_certificate("rogue", application_uri="urn:rogue").write(tmp_path, "rogue")
        client = await new_client(app.endpoint, rogue_cert, rogue_key)
        tamper_create_session(client, app.operator[0].read_bytes())
        exc = await refusal(client.connect())
        await close(client)
        assert status_of(exc) == "BadSecurityChecksFailed", exc
        await legit_infer(app)
    run(go())


def test_independent_client_after_the_attacks(app):
    run_node_client(app)


def test_a_message_changed_on_the_wire_is_refused_and_not_run(app):
    """One bit of a SignAndEncrypt request flipped after the client signed and encrypted it, in the last cipher block
    (it decrypts to the signature's last bytes only: the request itself stays intact): the server's HMAC check
    refuses it with BadSecurityChecksFailed and the Infer never runs; the next client is served."""
    async def go():
        client = await connect(app.endpoint, *app.operator)
        try:
            before = served(app)
            transport = client.uaclient.protocol.transport
            write = transport.write

            def flip_once(data):
                data = bytearray(data)
                if data[:3] == b"MSG":
                    data[-1] ^= 0x01
                    transport.write = write
                write(bytes(data))

            transport.write = flip_once
            exc = await refusal(infer_once(client))
            assert status_of(exc) == "BadSecurityChecksFailed", exc
            assert served(app) == before
        finally:
            await close(client)
        await legit_infer(app)
    run(go())
