/*
 * UDP echo on port 7777: lets a client on the guest network probe the guest (every
 * datagram goes back unchanged). Started only when livemig.ip configured eth0.
 */
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent.h"

void *echo_thread(void *arg)
{
    struct sockaddr_in addr = { .sin_family = AF_INET, .sin_port = htons(ECHO_PORT),
                                .sin_addr.s_addr = htonl(INADDR_ANY) };
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    static char buf[65536]; /* the largest UDP datagram */

    (void)arg;
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr))) {
        channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"echo: cannot bind udp/%d\"}\n",
                     ECHO_PORT);
        return NULL;
    }
    for (;;) {
        struct sockaddr_in from;
        socklen_t fl = sizeof(from);
        ssize_t n = recvfrom(fd, buf, sizeof(buf), 0, (struct sockaddr *)&from, &fl);
        if (n > 0) {
            sendto(fd, buf, (size_t)n, 0, (struct sockaddr *)&from, fl);
        }
    }
    return NULL;
}
