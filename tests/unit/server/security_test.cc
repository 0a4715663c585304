// TLS, mutual TLS and bearer tokens on a live server, with a CA and certificates made by the openssl CLI at
// test time; the per-connection call limit; the unix socket's permissions; the token file and comparison; the
// peer secret a fleet's servers act for their callers with.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"
#include "auth.h"
#include "e2e_util.h"
#include "server_test_util.h"

namespace attnd::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

int Shell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A throwaway PKI: ca signs the server and a client; other_ca signs a client of its own (the "wrong CA").
struct Pki {
  std::string dir;
  std::string Path(const std::string& name) const { return dir + "/" + name; }
};

Pki* pki = nullptr;

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/attnd_security_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    pki = new Pki{tmpl};
    const std::string d = pki->dir;
    WriteFile(d + "/server.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n");
    WriteFile(d + "/client.ext", "extendedKeyUsage=clientAuth\n");
    // A fleet server's certificate: it serves, and presents it as a client when a drain moves its sequences.
    WriteFile(d + "/peer.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n");
    const std::string key = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ";
    std::string script = "set -e; cd " + d + "\n";
    for (const char* ca : {"ca", "other_ca"}) {
      script += std::string("openssl req -x509") + key + "-keyout " + ca + ".key -out " + ca + ".pem -days 2 -subj /CN=" +
                ca + " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=keyCertSign,cRLSign\n";
    }
    auto leaf = [&](const std::string& name, const std::string& ca, const std::string& cn, const std::string& ext) {
      script += "openssl req" + key + "-keyout " + name + ".key -out " + name + ".csr -subj /CN=" + cn + "\n";
      script += "openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " + ca + ".key -CAcreateserial -out " +
                name + ".pem -days 2 -extfile " + ext + "\n";
    };
    leaf("server", "ca", "localhost", "server.ext");
    leaf("client", "ca", "attnd-client", "client.ext");
    leaf("peer", "ca", "localhost", "peer.ext");
    leaf("other_client", "other_ca", "intruder", "client.ext");
    WriteFile(d + "/make.sh", script);
    ASSERT_EQ(Shell("bash " + d + "/make.sh > " + d + "/make.log 2>&1"), 0) << ReadAll(d + "/make.log");
    WriteFile(d + "/tokens", "# attnd tokens\n\n  tok-alpha-0123456789  \ntok-beta-abcdef\n");
  }
  static void TearDownTestSuite() {
    Shell("rm -rf " + pki->dir);
    delete pki;
    pki = nullptr;
  }

  // A TLS channel to the server's TCP port trusting `ca`, with a client certificate when `client` is set.
  static std::shared_ptr<grpc::Channel> TlsChannel(const TestServer& s, const std::string& ca,
                                                   const std::string& client = "", bool own_connection = false) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadAll(pki->Path(ca + ".pem"));
    if (!client.empty()) {
      o.pem_cert_chain = ReadAll(pki->Path(client + ".pem"));
      o.pem_private_key = ReadAll(pki->Path(client + ".key"));
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel("localhost:" + std::to_string(s.server->tcp_port()), grpc::SslCredentials(o),
                                     args);
  }

  static server::ServerOptions TlsOptions(bool mutual) {
    server::ServerOptions o;
    o.network.listen = "127.0.0.1:0";
    o.security.tls_cert = pki->Path("server.pem");
    o.security.tls_key = pki->Path("server.key");
    if (mutual) o.security.tls_client_ca = pki->Path("ca.pem");
    return o;
  }

  // The client library over the server's plaintext loopback port, presenting `token` (none when empty).
  static std::unique_ptr<client::Client> ClientWithToken(const TestServer& s, const std::string& token,
                                                         bool own_connection = false) {
    client::ClientOptions co;
    co.target = "127.0.0.1:" + std::to_string(s.server->tcp_port());
    co.auth_token = token;
    co.own_connection = own_connection;
    auto c = client::Client::Create(co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // One small Forward; checks the answer when it succeeds.
  static grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel, const std::string& token = "",
                           const std::string& request_id = "") {
    auto stub = v1::Attention::NewStub(channel);
    v1::ForwardRequest r = MakeRequest({1, 16, 16, 2, 1, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, 77);
    if (!request_id.empty()) r.set_request_id(request_id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!token.empty()) ctx.AddMetadata("authorization", token);
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, r, &resp);
    if (s.ok()) ExpectCorrect(r, resp.o(), resp.lse());
    return s;
  }
};

TEST_F(SecurityTest, TlsCallWorksPlaintextAndUntrustedServerAreRefused) {
  TestServer s(TlsOptions(false));
  ASSERT_NE(s.server, nullptr);
  EXPECT_TRUE(Call(TlsChannel(s, "ca")).ok());
  const grpc::Status plain = Call(s.Channel());  // plaintext client against the TLS port
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();
  const grpc::Status wrong_ca = Call(TlsChannel(s, "other_ca"));  // the server's chain is not trusted
  EXPECT_EQ(wrong_ca.error_code(), grpc::StatusCode::UNAVAILABLE) << wrong_ca.error_message();
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheClientCa) {
  TestServer s(TlsOptions(true));
  ASSERT_NE(s.server, nullptr);
  EXPECT_TRUE(Call(TlsChannel(s, "ca", "client")).ok());
  const grpc::Status none = Call(TlsChannel(s, "ca"));
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAVAILABLE) << none.error_message();
  const grpc::Status other = Call(TlsChannel(s, "ca", "other_client"));
  EXPECT_EQ(other.error_code(), grpc::StatusCode::UNAVAILABLE) << other.error_message();
  EXPECT_EQ(Call(s.Channel()).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, BearerTokenOnEveryRpcButHealth) {
  server::ServerOptions o = TlsOptions(false);
  o.security.auth_token_file = pki->Path("tokens");
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  auto channel = TlsChannel(s, "ca");
  const grpc::Status missing = Call(channel);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(missing.error_message(), "authorization")) << missing.error_message();
  const grpc::Status wrong = Call(channel, "Bearer tok-alpha-012345678X");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(absl::StrContains(wrong.error_message(), "tok-alpha")) << "the presented token is never echoed";
  EXPECT_EQ(Call(channel, "tok-beta-abcdef").error_code(), grpc::StatusCode::UNAUTHENTICATED);  // no scheme
  EXPECT_EQ(Call(channel, "Bearer tok-alpha-0123456789x").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(channel, "Bearer tok-alpha-012345678").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Call(channel, "Bearer tok-alpha-0123456789").ok());
  EXPECT_TRUE(Call(channel, "bearer tok-beta-abcdef").ok());  // the scheme is case-insensitive

  // The metadata RPCs need it too; health does not (probes carry no credentials).
  auto stub = v1::Attention::NewStub(channel);
  grpc::ClientContext info_ctx;
  v1::ServerInfo info;
  EXPECT_EQ(stub->GetServerInfo(&info_ctx, v1::GetServerInfoRequest(), &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  client::ClientOptions co;
  co.target = "localhost:" + std::to_string(s.server->tcp_port());
  co.tls_ca_file = pki->Path("ca.pem");
  auto c = client::Client::Create(co);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->CheckHealth().ok());
  EXPECT_TRUE((*c)->CheckHealth("attnd.v1.Attention").ok());
  EXPECT_EQ((*c)->Stats().status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(SecurityTest, TokensOnPlaintextLoopbackAndTheUnixSocket) {
  server::ServerOptions o;
  o.network.listen = "127.0.0.1:0";
  o.network.unix_socket = pki->Path("attnd.sock");
  o.security.auth_token_file = pki->Path("tokens");
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  for (const std::string& target : {std::string(""), "unix:" + o.network.unix_socket}) {
    SCOPED_TRACE(target);
    EXPECT_EQ(Call(s.Channel(target)).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_TRUE(Call(s.Channel(target), "Bearer tok-beta-abcdef").ok());
  }
}

// Steps travel on a StepStream, which carries the token like any call: without one the stream is refused, and a
// sequence opened with one token does not exist for a step presented with another.
TEST_F(SecurityTest, StepStreamsCarryTheTokenAndItsOwnership) {
  server::ServerOptions o;
  o.network.listen = "127.0.0.1:0";
  o.security.auth_token_file = pki->Path("tokens");
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  // Separate connections, then one connection shared by all three callers: gRPC gives every call on a
  // connection the same auth context, so a call's owner must come from its own header, never the connection's.
  for (const bool own_connection : {true, false}) {
    SCOPED_TRACE(own_connection ? "a connection each" : "one shared connection");
    auto alpha = ClientWithToken(s, "tok-alpha-0123456789", own_connection);
    auto beta = ClientWithToken(s, "tok-beta-abcdef", own_connection);
    auto none = ClientWithToken(s, "", own_connection);
    ASSERT_TRUE(alpha && beta && none);
    client::SequenceShape shape;
    shape.layers = 1;
    shape.kv_heads = 2;
    shape.head_dim = 64;
    auto opened = alpha->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const std::string k(2 * 64 * 2, '\1'), v(2 * 64 * 2, '\2');
    client::StepSpec spec;
    spec.sequences = {{opened->ids[0], 1}};
    spec.k.data = k;
    spec.v.data = v;
    auto mine = alpha->Step(spec);
    ASSERT_TRUE(mine.ok()) << mine.status();
    EXPECT_EQ(mine->transport, client::Transport::kStream);
    EXPECT_EQ(none->Step(spec).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(beta->Step(spec).status().code(), absl::StatusCode::kNotFound);
    auto again = alpha->Step(spec);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->lengths, std::vector<int64_t>({2}));  // the refused steps appended nothing
  }
}

TEST_F(SecurityTest, TokensOnAPlaintextNetworkListenerAreRefusedAtStart) {
  server::ServerOptions o;
  o.network.listen = "0.0.0.0:0";
  o.security.auth_token_file = pki->Path("tokens");
  auto created = server::Server::Create(o, std::make_unique<server::CpuBackend>(server::BackendOptions{}));
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(created.status().message(), "auth_token_file")) << created.status();
  EXPECT_TRUE(absl::StrContains(created.status().message(), "--tls_cert")) << created.status();
}

TEST_F(SecurityTest, BadSecurityOptionsFailTheStartNamingTheFlag) {
  struct Case {
    std::string cert, key, client_ca, tokens, expect;
  };
  WriteFile(pki->Path("empty_tokens"), "# none yet\n\n");
  const Case cases[] = {
      {"", pki->Path("server.key"), "", "", "tls_cert"},
      {pki->Path("server.pem"), "", "", "", "tls_key"},
      {"", "", pki->Path("ca.pem"), "", "tls_cert"},
      {pki->Path("missing.pem"), pki->Path("server.key"), "", "", "tls_cert"},
      {pki->Path("server.pem"), pki->Path("tokens"), "", "", "tls_key"},  // not PEM
      {pki->Path("server.pem"), pki->Path("client.key"), "", "", "tls_key: '" + pki->Path("client.key") +
                                                                  "' is not the private key of the certificate"},
      {pki->Path("server.pem"), pki->Path("server.csr"), "", "", "tls_key: '" + pki->Path("server.csr") +
                                                                  "' holds no readable private key"},
      {pki->Path("server.key"), pki->Path("server.key"), "", "", "tls_cert: '" + pki->Path("server.key") +
                                                                  "' holds no readable certificate"},
      {pki->Path("server.pem"), pki->Path("server.key"), pki->Path("nope.pem"), "", "tls_client_ca"},
      {"", "", "", pki->Path("empty_tokens"), "auth_token_file"},
      {"", "", "", pki->Path("no_such_file"), "auth_token_file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expect + " " + c.cert + " " + c.key + " " + c.client_ca + " " + c.tokens);
    server::ServerOptions o;
    o.network.listen = "127.0.0.1:0";
    o.security.tls_cert = c.cert;
    o.security.tls_key = c.key;
    o.security.tls_client_ca = c.client_ca;
    o.security.auth_token_file = c.tokens;
    auto created = server::Server::Create(o, std::make_unique<server::CpuBackend>(server::BackendOptions{}));
    ASSERT_FALSE(created.ok());
    EXPECT_TRUE(absl::StartsWith(created.status().message(), c.expect)) << created.status();
  }
}

TEST_F(SecurityTest, ClientLibraryAndAttnSpeakMutualTlsWithAToken) {
  server::ServerOptions o = TlsOptions(true);
  o.security.auth_token_file = pki->Path("tokens");
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  const std::string target = "localhost:" + std::to_string(s.server->tcp_port());
  client::ClientOptions co;
  co.target = target;
  co.tls_ca_file = pki->Path("ca.pem");
  co.tls_cert_file = pki->Path("client.pem");
  co.tls_key_file = pki->Path("client.key");
  co.auth_token = "tok-alpha-0123456789";
  for (client::Transport t : {client::Transport::kUnary, client::Transport::kStream}) {
    co.transport = t;
    co.stream_chunk_bytes = 4096;
    auto c = client::Client::Create(co);
    ASSERT_TRUE(c.ok()) << c.status();
    const v1::ForwardRequest r = MakeRequest({2, 40, 40, 2, 2, 64}, v1::MASK_TYPE_NONE, true, 31);
    auto res = (*c)->Forward(r);
    ASSERT_TRUE(res.ok()) << res.status();
    ExpectCorrect(r, res->o, res->lse);
  }
  co.tls_key_file.clear();
  EXPECT_EQ(client::Client::Create(co).status().code(), absl::StatusCode::kInvalidArgument);

  // The attn binary with the same credentials: --verify checks the answer against the f64 reference.
  WriteFile(pki->Path("client_token"), "# mine\ntok-beta-abcdef\n");
  const std::string base = std::string(ATTN_BINARY) + " call --target=" + target + " --tls_ca=" + pki->Path("ca.pem") +
                           " --tls_cert=" + pki->Path("client.pem") + " --tls_key=" + pki->Path("client.key") +
                           " --batch=1 --q_len=24 --q_heads=2 --head_dim=64 --verify";
  EXPECT_EQ(Shell(base + " --auth_token_file=" + pki->Path("client_token") + " > /dev/null 2>&1"), 0);
  EXPECT_NE(Shell(base + " > /dev/null 2>&1"), 0) << "no token: refused";
}

TEST_F(SecurityTest, PerConnectionCallLimit) {
  // Over TCP and over the unix socket, where every connection has the same peer address ("unix:"): the limit
  // is per connection all the same.
  for (const bool unix_socket : {false, true}) {
    SCOPED_TRACE(unix_socket ? "unix socket" : "tcp");
    Gate gate;
    server::ServerOptions o;
    o.limits.max_calls_per_client = 2;
    if (unix_socket) o.network.unix_socket = pki->Path("limit.sock");
    server::BackendOptions bo;
    bo.threads = 2;
    TestServer s(o, bo, gate.Hooks());
    ASSERT_NE(s.server, nullptr);
    const std::string target =
        unix_socket ? "unix:" + o.network.unix_socket : "127.0.0.1:" + std::to_string(s.server->tcp_port());
    const auto own_connection = [&] {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    };
    auto mine = own_connection();
    std::vector<std::thread> holders;
    for (int i = 0; i < 2; ++i) holders.emplace_back([&] { EXPECT_TRUE(Call(mine).ok()); });
    EXPECT_TRUE(WaitFor([&] { return gate.entered() == 2; }));
    // The same connection is at its limit; another connection is not.
    const grpc::Status over = Call(mine);
    EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_TRUE(absl::StrContains(over.error_message(), "max_calls_per_client")) << over.error_message();
    auto other = own_connection();
    grpc::Status theirs;
    std::thread caller([&] { theirs = Call(other); });
    // Its call is admitted and queued behind the held two (RESOURCE_EXHAUSTED would come back at once).
    EXPECT_TRUE(WaitFor([&] { return s.cpu->queue_depth() == 1; }));
    gate.Open();
    caller.join();
    EXPECT_TRUE(theirs.ok()) << theirs.error_message();
    for (auto& h : holders) h.join();
    EXPECT_TRUE(Call(mine).ok()) << "the slot is free again once the call ended";
  }
}

TEST_F(SecurityTest, UnixSocketPermissions) {
  for (uint32_t mode : {0660u, 0600u}) {
    server::ServerOptions o;
    o.network.listen = "";
    o.network.unix_socket = pki->Path("perm.sock");
    o.network.unix_socket_mode = mode;
    TestServer s(o);
    ASSERT_NE(s.server, nullptr);
    struct stat st;
    ASSERT_EQ(::stat(o.network.unix_socket.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, mode);
    EXPECT_TRUE(Call(s.Channel("unix:" + o.network.unix_socket)).ok());
  }
}

// A fleet's server acts for a caller with the peer secret: the owner it names is the call's owner, admitted without
// a bearer token. A wrong secret, or a missing owner, is refused naming the key, with or without a token.
TEST_F(SecurityTest, APeerSecretActsAsTheOwnerItNames) {
  WriteFile(pki->Path("peer_secret"), "  fleet-secret-42\n");
  server::ServerOptions o;
  o.network.listen = "127.0.0.1:0";
  o.security.auth_token_file = pki->Path("tokens");
  o.security.peer_secret_file = pki->Path("peer_secret");
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  auto alpha = ClientWithToken(s, "tok-alpha-0123456789");
  auto peer = ClientWithToken(s, "");
  ASSERT_TRUE(alpha && peer);
  client::SequenceShape shape;
  shape.layers = 1;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  auto opened = alpha->OpenSequence(shape);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->ids[0];
  auto as = [](const std::string& secret, const std::string& owner) {
    client::CallOptions call;
    if (!secret.empty()) call.metadata.emplace_back("attnd-peer-secret", secret);
    if (!owner.empty()) call.metadata.emplace_back("attnd-owner", owner);
    return call;
  };
  // The first token's owner is "token:0": the peer reads its sequence, another owner's view does not have it.
  auto info = peer->GetSequence(id, as("fleet-secret-42", "token:0"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequence_id(), id);
  EXPECT_EQ(peer->GetSequence(id, as("fleet-secret-42", "token:1")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(peer->GetSequence(id).status().code(), absl::StatusCode::kUnauthenticated);

  const absl::Status wrong = peer->GetSequence(id, as("fleet-secret-43", "token:0")).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(absl::StrContains(wrong.message(), "attnd-peer-secret")) << wrong;
  EXPECT_FALSE(absl::StrContains(wrong.message(), "fleet-secret")) << "the presented secret is never echoed";
  const absl::Status wrong_with_token = alpha->GetSequence(id, as("fleet-secret-43", "token:0")).status();
  EXPECT_EQ(wrong_with_token.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(wrong_with_token.message(), "attnd-peer-secret")) << wrong_with_token;
  const absl::Status no_owner = peer->GetSequence(id, as("fleet-secret-42", "")).status();
  EXPECT_EQ(no_owner.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(no_owner.message(), "attnd-owner")) << no_owner;
  const absl::Status no_secret = alpha->GetSequence(id, as("", "token:1")).status();
  EXPECT_EQ(no_secret.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(no_secret.message(), "attnd-peer-secret")) << no_secret;
  // Closed as its owner by the peer: the sequence is gone for its caller too.
  ASSERT_TRUE(peer->CloseSequence({id}, as("fleet-secret-42", "token:0")).ok());
  EXPECT_EQ(alpha->GetSequence(id).status().code(), absl::StatusCode::kNotFound);
}

// A server without --peer_secret_file refuses peer metadata on every kind of call, naming the key: a caller that
// meant to act as someone else must not silently act as itself.
TEST_F(SecurityTest, PeerMetadataWithoutAPeerSecretIsRefusedNamingTheKey) {
  server::ServerOptions o;
  o.network.listen = "127.0.0.1:0";
  TestServer s(o);
  ASSERT_NE(s.server, nullptr);
  auto stub = s.Stub();
  // Each call with peer metadata on a context of its own; `call` makes the call and returns its status.
  const auto expect_refused = [](const char* what, const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    SCOPED_TRACE(what);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    ctx.AddMetadata("attnd-peer-secret", "anything");
    ctx.AddMetadata("attnd-owner", "token:0");
    const grpc::Status st = call(&ctx);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "attnd-peer-secret")) << st.error_message();
  };
  expect_refused("GetServerInfo", [&](grpc::ClientContext* ctx) {
    v1::ServerInfo info;
    return stub->GetServerInfo(ctx, v1::GetServerInfoRequest(), &info);
  });
  expect_refused("OpenSequence", [&](grpc::ClientContext* ctx) {
    v1::OpenSequenceRequest open;
    open.mutable_shape()->set_layers(1);
    v1::OpenSequenceResponse opened;
    return stub->OpenSequence(ctx, open, &opened);
  });
  expect_refused("StepStream", [&](grpc::ClientContext* ctx) {
    auto stream = stub->StepStream(ctx);
    v1::StepStreamResponse answer;
    EXPECT_FALSE(stream->Read(&answer));
    return stream->Finish();
  });
  expect_refused("ExportSequence", [&](grpc::ClientContext* ctx) {
    v1::ExportSequenceRequest request;
    request.set_sequence_id("x");
    auto reader = stub->ExportSequence(ctx, request);
    v1::ExportSequenceResponse chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    return reader->Finish();
  });
  expect_refused("ImportSequence", [&](grpc::ClientContext* ctx) {
    v1::ImportSequenceResponse imported;
    auto writer = stub->ImportSequence(ctx, &imported);
    writer->WritesDone();
    return writer->Finish();
  });
  grpc::ClientContext plain;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&plain, v1::GetServerInfoRequest(), &info).ok());
}

TEST_F(SecurityTest, DrainToAndThePeerSecretAreCheckedAtStart) {
  WriteFile(pki->Path("peer_secret"), "fleet-secret-42\n");
  WriteFile(pki->Path("empty_secret"), " \n\n");
  struct Case {
    std::string drain_to;
    double drain_s;
    std::string secret, expect;
  };
  const Case cases[] = {
      {"127.0.0.1:1", 0, pki->Path("peer_secret"), "sequence_drain_to: needs --sequence_drain_s"},
      {"127.0.0.1:1", 5, "", "sequence_drain_to: needs --peer_secret_file"},
      {"", 0, pki->Path("empty_secret"), "peer_secret_file: '" + pki->Path("empty_secret") + "' is empty"},
      {"", 0, pki->Path("no_such_secret"), "peer_secret_file: cannot read"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expect);
    server::ServerOptions o;
    o.network.listen = "127.0.0.1:0";
    o.drain.to = c.drain_to;
    o.timeouts.sequence_drain = absl::Seconds(c.drain_s);
    o.security.peer_secret_file = c.secret;
    auto created = server::Server::Create(o, std::make_unique<server::CpuBackend>(server::BackendOptions{}));
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(created.status().message(), c.expect)) << created.status();
  }
  // With TLS the moves speak TLS: they need the CA the fleet's certificates chain to, and a readable one.
  for (const std::string& ca : {std::string(), pki->Path("no_such_ca.pem")}) {
    server::ServerOptions o = TlsOptions(false);
    o.drain.to = "127.0.0.1:1";
    o.timeouts.sequence_drain = absl::Seconds(5);
    o.security.peer_secret_file = pki->Path("peer_secret");
    o.security.peer_tls_ca = ca;
    auto created = server::Server::Create(o, std::make_unique<server::CpuBackend>(server::BackendOptions{}));
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(created.status().message(), ca.empty() ? "sequence_drain_to: with --tls_cert"
                                                                        : "peer_tls_ca: cannot read"))
        << created.status();
  }
  server::ServerOptions o;
  o.network.listen = "127.0.0.1:0";
  o.drain.to = "127.0.0.1:1";
  o.timeouts.sequence_drain = absl::Seconds(5);
  o.security.peer_secret_file = pki->Path("peer_secret");
  TestServer s(o);
  EXPECT_NE(s.server, nullptr);
}

// A drain between servers that require mutual TLS: A, shut down with --sequence_drain_to B, moves its sequences to
// B over TLS (verified against --peer_tls_ca, its own certificate presented as the client's) as each one's owner,
// and the caller, over TLS with its own certificate, follows each old id to B and finds every token there.
TEST_F(SecurityTest, ADrainMovesSequencesBetweenMutualTlsServers) {
  WriteFile(pki->Path("peer_secret"), "fleet-secret-42\n");
  std::string address[2];
  std::unique_ptr<TestServer> servers[2];
  for (int i : {1, 0}) {  // B first: A's drain moves to it
    const int port = e2e::FreeLoopbackPort();
    ASSERT_GT(port, 0);
    address[i] = absl::StrCat("127.0.0.1:", port);
    server::ServerOptions o = TlsOptions(/*mutual=*/true);
    o.network.listen = address[i];
    o.security.tls_cert = pki->Path("peer.pem");
    o.security.tls_key = pki->Path("peer.key");
    o.security.peer_secret_file = pki->Path("peer_secret");
    o.sequences.advertise_address = address[i];
    if (i == 0) {
      o.drain.to = address[1];
      o.timeouts.sequence_drain = absl::Seconds(10);
      o.security.peer_tls_ca = pki->Path("ca.pem");
    }
    servers[i] = std::make_unique<TestServer>(o);
    ASSERT_NE(servers[i]->server, nullptr);
  }
  client::ClientOptions co;
  co.target = address[0];
  co.tls_ca_file = pki->Path("ca.pem");
  co.tls_cert_file = pki->Path("client.pem");
  co.tls_key_file = pki->Path("client.key");
  auto created = client::Client::Create(co);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<client::Client> caller = std::move(*created);
  client::SequenceShape shape;
  shape.layers = 1;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  shape.dtype = DType::kBF16;
  auto opened = caller->OpenSequence(shape, /*max_tokens=*/0, /*count=*/2);
  ASSERT_TRUE(opened.ok()) << opened.status();
  for (size_t i = 0; i < opened->ids.size(); ++i) {
    const int64_t tokens = 5 + 3 * static_cast<int64_t>(i);
    const std::string k = client::RandomTensor(shape.dtype, tokens * shape.kv_heads * shape.head_dim, 10 + i);
    client::StepSpec spec;
    spec.sequences = {{opened->ids[i], tokens}};
    spec.k.data = k;
    spec.v.data = k;
    auto r = caller->Step(spec);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  std::thread drain([&] { servers[0]->server->Shutdown(); });
  // Each old id, asked until it answers from B: the caller is told where it went (which lets A's drain end).
  for (size_t i = 0; i < opened->ids.size(); ++i) {
    absl::StatusOr<v1::SequenceInfo> info;
    for (const absl::Time give_up = absl::Now() + absl::Seconds(10);; absl::SleepFor(absl::Milliseconds(20))) {
      info = caller->GetSequence(opened->ids[i]);
      if ((info.ok() && client::SequenceAddress(info->sequence_id()) == address[1]) || absl::Now() > give_up) break;
    }
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(client::SequenceAddress(info->sequence_id()), address[1]);
    ASSERT_EQ(info->lengths_size(), 1);
    EXPECT_EQ(info->lengths(0), 5 + 3 * static_cast<int64_t>(i));
  }
  drain.join();
  EXPECT_EQ(caller->moves_followed(), 2u);
}

TEST(AuthTokensTest, FileParsingAndConstantTimeComparison) {
  char tmpl[] = "/tmp/attnd_tokens_XXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ::close(fd);
  WriteFile(tmpl, "# comment\n\n  a-token \r\nsecond\n#not-a-token\n");
  auto tokens = server::LoadAuthTokens(tmpl);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(*tokens, (std::vector<std::string>{"a-token", "second"}));
  ::unlink(tmpl);

  EXPECT_TRUE(server::ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(server::ConstantTimeEquals("secreT", "secret"));
  EXPECT_FALSE(server::ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(server::ConstantTimeEquals("secret2", "secret"));
  EXPECT_FALSE(server::ConstantTimeEquals("", "secret"));
  EXPECT_FALSE(server::ConstantTimeEquals(std::string("sec\0et", 6), "secret"));
}

}  // namespace
}  // namespace attnd::testing
