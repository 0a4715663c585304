// Session 29: a host model of the d128 kernel's TryStep check on hopper_trace's inputs (mt19937(1234), normal, bf16;
// q then k then v), for chosen causal tiles of head h: counts warp-blocks whose TryStep is rejected, under main's rule
// (the reference moves only past max + 8) and with v48's (moved to the row max after a rejection).
// g++ -O3 -march=native -o trystep_model trystep_model.cc && ./trystep_model HEAD QTILE...
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
static float bf16(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  u += 0x7fff + ((u >> 16) & 1); u &= 0xffff0000u;
  float y; std::memcpy(&y, &u, 4); return y;
}
int main(int argc, char** argv) {
  const int B = 1, S = 16384, H = 16, D = 128;
  const size_t elems = size_t(B) * S * H * D;
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(elems), k(elems);
  for (auto& x : q) x = bf16(nd(rng));
  for (auto& x : k) x = bf16(nd(rng));
  const float scale_log2 = (1.0f / std::sqrt(128.f)) * 1.4426950408889634f;
  const int head = std::atoi(argv[1]);
  for (int a = 2; a < argc; ++a) {
    const int qt = std::atoi(argv[a]);
    const int n = qt + 1;
    long fails_cur = 0, fails_fix = 0, blocks_cur_w = 0;
    for (int w = 0; w < 8; ++w) {  // 8 warps x 16 rows
      // Raw scores for the warp's 16 rows over all visible keys.
      const int rows0 = qt * 128 + w * 16;
      std::vector<float> s(16 * (size_t)n * 128);
      for (int r = 0; r < 16; ++r) {
        const float* qr = &q[((size_t)(rows0 + r) * H + head) * D];
        for (int key = 0; key < n * 128; ++key) {
          const float* kr = &k[((size_t)key * H + head) * D];
          float acc = 0; for (int d = 0; d < D; ++d) acc += qr[d] * kr[d];
          s[(size_t)r * n * 128 + key] = acc;
        }
      }
      for (int fix = 0; fix < 2; ++fix) {
        float m[16];
        for (int r = 0; r < 16; ++r) m[r] = -INFINITY;
        long fails = 0;
        for (int b = n - 1; b >= 0; --b) {
          const bool masked = b == n - 1;
          bool ok = !masked;
          if (!masked) {
            for (int r = 0; r < 16 && ok; ++r)
              for (int t = 0; t < 4 && ok; ++t) {
                double bs = 0;
                for (int i = 0; i < 16; ++i)
                  for (int e = 0; e < 2; ++e) {
                    const int key = b * 128 + 8 * i + 2 * t + e;
                    bs += std::exp2((double)s[(size_t)r * n * 128 + key] * scale_log2 - m[r]);
                  }
                if (!(bs <= 256.0)) ok = false;
              }
            if (!ok) ++fails;
          }
          if (!ok) {  // the full Step
            for (int r = 0; r < 16; ++r) {
              float mx = -INFINITY;
              for (int c = 0; c < 128; ++c) {
                const int key = b * 128 + c;
                if (masked && key > rows0 + r) continue;
                mx = std::fmax(mx, s[(size_t)r * n * 128 + key] * scale_log2);
              }
              const float thr = (fix && !masked) ? 0.f : 8.f;
              if (mx > m[r] + thr || (m[r] == -INFINITY && mx > -INFINITY)) m[r] = mx;
            }
          }
        }
        (fix ? fails_fix : fails_cur) += fails;
      }
    }
    std::printf("head %d qt %d: %d blocks; failed warp-blocks: current %ld, fixed %ld\n", head, qt, n, fails_cur, fails_fix);
    std::fflush(stdout);
  }
}
